"""HetPipe's virtual-worker placement (``pipeline/vw_placement.py``): NP / ED / HD, the cost
model, and a brute-force oracle on small clusters."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.cluster.spec import ClusterSpec, DeviceSpec, Link
from flotilla.core.errors import ConfigError
from flotilla.pipeline.partition import brute_force_partition, partition
from flotilla.pipeline.plan import PartitionOptions, PlanError, evaluate_plan, memory_shortfalls
from flotilla.pipeline.profile import LayerProfile, ModelProfile
from flotilla.pipeline.vw_placement import (
    Placement,
    WaveSettings,
    choose,
    equal_groups,
    job_estimate,
    place,
)
from flotilla.pipeline.vw_report import alternatives

MiB = 2**20
# 6 layers of 1 MiB of parameters each: with SGD+momentum (x3) the model needs ~18 MiB and more
PROFILE = ModelProfile.uniform(6, forward_s=0.01, backward_s=0.02, activation_bytes=64 * 1024,
                               param_bytes=MiB, batch_size=8)  # fmt: skip
OPTIONS = PartitionOptions(allow_replication=False)


def _cluster(spec: Sequence[tuple[str, str, float, int]]) -> ClusterSpec:
    """(node, type, speed, memory MiB) per device, named d0, d1, ..."""
    devices = tuple(
        DeviceSpec(name=f"d{i}", node=node, type=kind, speed=speed, memory_bytes=mem * MiB)
        for i, (node, kind, speed, mem) in enumerate(spec)
    )
    return ClusterSpec(devices=devices)


# HetPipe's cluster in small: four nodes of one device type each, fast to slow; the two weakest
# nodes cannot hold the model (their devices have 6 MiB each: 12 MiB per node, the model needs ~18)
PAPER = _cluster(
    [("n0", "V", 1.0, 40)] * 2
    + [("n1", "R", 0.6, 40)] * 2
    + [("n2", "G", 0.4, 6)] * 2
    + [("n3", "Q", 0.25, 6)] * 2
)


def _check_valid(p: Placement, cluster: ClusterSpec) -> None:
    seen = [name for vw in p.vws for name in vw.devices]
    assert len(seen) == len(set(seen)), "a device in two virtual workers"
    idle = [name for vw in p.vws for name in vw.plan.unused_devices]
    assert sorted(set(seen) - set(idle) | set(p.unused)) == sorted(cluster.names)
    assert not (set(seen) - set(idle)) & set(p.unused)
    by_name = {d.name: d for d in cluster.devices}
    for vw in p.vws:
        assert not memory_shortfalls(vw.plan, [by_name[n] for n in vw.devices])
        assert {n for s in vw.plan.stages for n in s.devices} <= set(vw.devices)


def test_the_paper_cluster_np_is_refused_naming_the_node_ed_and_hd_place_it() -> None:
    choice = choose(PAPER, PROFILE, options=OPTIONS, settings=WaveSettings(s_local=3, clock_distance=0))
    assert "node 'n2' cannot hold the model" in choice.refused["np"]
    ed, hd = choice.placements["ed"], choice.placements["hd"]
    for p in (ed, hd):
        _check_valid(p, PAPER)
    # ED: two VWs, each one device of every type
    kinds = {d.name: d.type for d in PAPER.devices}
    assert [sorted(kinds[n] for n in vw.devices) for vw in ed.vws] == [["G", "Q", "R", "V"]] * 2
    # HD: the two nodes that hold the model alone are VWs of their own, the rest shared equally
    assert [vw.devices for vw in hd.vws][:2] == [("d0", "d1"), ("d2", "d3")]
    assert choice.chosen.throughput_samples_per_s == max(
        ed.throughput_samples_per_s, hd.throughput_samples_per_s
    )


def test_with_a_finite_clock_distance_the_slowest_vw_paces_the_job() -> None:
    # two nodes, one twice as fast: NP pairs fast with fast, ED mixes them
    cluster = _cluster([("a", "fast", 1.0, 40)] * 2 + [("b", "slow", 0.5, 40)] * 2)
    choice = choose(cluster, PROFILE, options=OPTIONS, settings=WaveSettings(s_local=1, clock_distance=0))
    np_, ed = choice.placements["np"], choice.placements["ed"]
    slow = max(vw.wave_s for vw in np_.vws)
    assert np_.estimate.wave_s == pytest.approx(slow)
    assert np_.throughput_samples_per_s == pytest.approx(2 * 2 * PROFILE.batch_size / slow)
    assert ed.throughput_samples_per_s > np_.throughput_samples_per_s  # balanced VWs win
    assert choice.chosen.policy in ("ed", "hd") and choice.chosen.throughput_samples_per_s == pytest.approx(
        ed.throughput_samples_per_s
    )


def test_the_servers_bandwidth_bounds_the_wave() -> None:
    cluster = _cluster([("a", "x", 1.0, 12)] * 4)  # (a VW needs two devices: two stages)
    thin = WaveSettings(s_local=0, ps_link=Link(bandwidth_gbps=0.01, latency_s=0.0))
    p = place("ed", cluster, PROFILE, OPTIONS, thin)
    k = len(p.vws)
    assert all(vw.plan.num_stages >= 2 for vw in p.vws)
    servers = 2 * k * PROFILE.total_param_bytes / (0.01e9 / 8)
    assert p.estimate.servers_s == pytest.approx(servers)
    assert p.estimate.wave_s >= servers
    # a VW's own sync: each stage's push + pull of its layers, all stages at once
    for vw in p.vws:
        biggest = max(s.layer_end - s.layer_start for s in vw.plan.stages) * MiB
        assert vw.wave_sync_s == pytest.approx(2 * biggest / (0.01e9 / 8))


def test_a_wave_hides_only_the_sync_its_next_s_local_minibatches_cover() -> None:
    cluster = _cluster([("a", "x", 1.0, 40)] * 2)
    thin = Link(bandwidth_gbps=0.2, latency_s=0.0)
    waves = {}
    for s_local in (0, 1, 7):
        p = place("np", cluster, PROFILE, OPTIONS, WaveSettings(s_local=s_local, ps_link=thin))
        (vw,) = p.vws
        minibatch = vw.wave_compute_s / (s_local + 1)
        assert vw.overlap_s == pytest.approx(s_local * minibatch)
        # the wave's gated last minibatch goes through the whole pipeline alone after the pull
        alone = sum(stage.compute_s + stage.comm_s for stage in vw.plan.stages)
        assert vw.latency_s == pytest.approx(alone) and alone >= minibatch * (1 - 1e-9)
        assert vw.wave_s == pytest.approx(max(vw.wave_compute_s, vw.wave_sync_s + alone))
        waves[s_local] = vw
    zero = waves[0]  # (nothing hidden: one minibatch at a time, the sync between two)
    assert zero.wave_s == pytest.approx(zero.wave_sync_s + zero.latency_s)
    assert zero.wave_s >= zero.wave_compute_s + zero.wave_sync_s - 1e-12
    assert waves[7].wave_s == pytest.approx(
        max(waves[7].wave_compute_s, waves[7].wave_sync_s + waves[7].latency_s)
    )
    assert waves[7].wave_s < waves[7].wave_compute_s + waves[7].wave_sync_s  # (s_local hides some)


def test_bad_input_is_one_line_naming_what_is_wrong() -> None:
    tiny = _cluster([("a", "x", 1.0, 2)] * 2)
    with pytest.raises(PlanError) as err:
        choose(tiny, PROFILE, options=OPTIONS)
    line = str(err.value)
    assert "\n" not in line and "no placement holds the model" in line and "short" in line and "d0" in line
    with pytest.raises(ConfigError, match="placement must be one of np, ed, hd or 'auto'; got 'xd'"):
        choose(PAPER, PROFILE, policy="xd")
    with pytest.raises(ConfigError, match="strategy.s_local must be an integer >= 0"):
        WaveSettings(s_local=-1)
    with pytest.raises(ConfigError, match="strategy.clock_distance must be an integer >= 0"):
        WaveSettings(clock_distance=-2)
    with pytest.raises(PlanError, match="placement 'np': node 'n2' cannot hold the model"):
        choose(PAPER, PROFILE, policy="np", options=OPTIONS)


def test_the_alternatives_without_virtual_workers() -> None:
    dp, pp = alternatives(PAPER, PROFILE, OPTIONS)
    assert dp.devices == ("d0", "d1", "d2", "d3")  # the devices that hold the model alone
    by_name = {d.name: d for d in PAPER.devices}
    one = evaluate_plan(PROFILE, [by_name[n] for n in dp.devices], None, OPTIONS, [6], [list(dp.devices)])
    assert dp.throughput_samples_per_s == pytest.approx(one.throughput_samples_per_s)
    assert pp.throughput_samples_per_s == pytest.approx(
        partition(PROFILE, PAPER, options=OPTIONS).throughput_samples_per_s
    )
    weak = _cluster([("a", "x", 1.0, 16)] * 2)  # (together they hold the model, neither alone)
    dp, pp = alternatives(weak, PROFILE, OPTIONS)
    assert dp.throughput_samples_per_s is None and dp.note == "no device holds the model alone"
    assert pp.throughput_samples_per_s is not None and len(pp.devices) == 2


def test_a_grouping_too_large_for_the_partitioners_search_is_a_reason_not_a_crash() -> None:
    tiny = replace(OPTIONS, max_search_work=100_000)  # (the one-VW grouping of 8 devices exceeds it)
    choice = choose(PAPER, PROFILE, "ed", tiny)
    assert len(choice.chosen.vws) == 2  # (two VWs of one device of each type still fit the search)
    with pytest.raises(PlanError, match="1 VW.*too large a pipeline to plan"):
        choose(PAPER, PROFILE, "ed", replace(tiny, max_search_work=20))  # (nothing fits the search)


def test_equal_groups_deal_every_type_evenly_or_refuse() -> None:
    devices = PAPER.devices
    groups = equal_groups(devices, 2)
    assert groups is not None
    assert all(Counter(d.type for d in g) == Counter({"V": 1, "R": 1, "G": 1, "Q": 1}) for g in groups)
    assert equal_groups(devices, 3) is None
    assert equal_groups(devices[:3], 2) is None  # V, V, R: R cannot be split in two


# ------------------------------------------------------------------ properties and the oracle

_device = st.tuples(
    st.sampled_from(["n0", "n1", "n2"]),
    st.sampled_from(["A", "B"]),
    st.sampled_from([0.25, 0.5, 1.0]),
    st.sampled_from([4, 8, 12, 40]),
)
_clusters = st.lists(_device, min_size=1, max_size=5).map(_cluster)
_settings = st.builds(
    WaveSettings,
    s_local=st.integers(0, 3),
    clock_distance=st.integers(0, 2),
    ps_link=st.sampled_from([None, Link(bandwidth_gbps=0.2, latency_s=0.001)]),  # (a thin link: sync shows)
    ps_shards=st.integers(1, 2),
)


def _set_partitions(items: list[str]) -> Iterator[list[list[str]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]
        yield [[first], *part]


def _oracle_best(cluster: ClusterSpec, settings_: WaveSettings) -> float:
    """The fastest job over EVERY grouping of the devices into VWs (some devices may stay out),
    each VW cut as the placement cuts one (the partitioner, whose slowest stage the test checks
    against the brute-force partitioner's: among cuts with that slowest stage the wave's sync
    differs, so a brute-force cut here would compare two rules, not the groupings)."""
    by_name = {d.name: d for d in cluster.devices}
    best = 0.0
    for part in _set_partitions(list(cluster.names)):
        for keep in range(1, 2 ** len(part)):
            groups = [g for i, g in enumerate(part) if keep >> i & 1]
            options = [_cuts(g, by_name, cluster) for g in groups]
            for vws in itertools.product(*options):  # (none when a group cannot hold the model)
                best = max(best, _estimate_of(list(vws), cluster, settings_))
    return best


def _cuts(group: list[str], by_name: dict, cluster: ClusterSpec) -> list:
    """The partitioner's cut of ``group`` in EVERY order of its devices (the pipeline's order is
    the placement's choice: the same slowest stage can come with another wave sync; a suite
    run, 2026-12-01, found a placement's order beating the cluster order's by 0.3 %)."""
    links, out = cluster.links.among(set(group)), {}
    for order in itertools.permutations(group):
        try:
            plan = partition(PROFILE, [by_name[n] for n in order], links, OPTIONS)
        except PlanError:
            continue
        out[tuple((s.layer_end, s.devices) for s in plan.stages)] = plan  # (one per distinct cut)
    return list(out.values())


def _estimate_of(plans: list, cluster: ClusterSpec, settings_: WaveSettings) -> float:
    from flotilla.pipeline.vw_placement import VirtualWorker

    link = settings_.ps_link or Link(
        bandwidth_gbps=cluster.links.default_bandwidth_gbps, latency_s=cluster.links.latency_s
    )
    link_bps = link.bandwidth_gbps * 1e9 / 8
    vws = []
    for plan in plans:
        params = [(s.layer_end - s.layer_start) * MiB for s in plan.stages]
        vws.append(
            VirtualWorker(
                devices=tuple(n for s in plan.stages for n in s.devices),
                plan=plan,
                wave_compute_s=settings_.wave_size * PROFILE.batch_size / plan.throughput_samples_per_s,
                wave_sync_s=max(2 * (link.latency_s + b / link_bps) for b in params),
                overlap_s=settings_.s_local * PROFILE.batch_size / plan.throughput_samples_per_s,
            )
        )
    return job_estimate(vws, PROFILE, cluster, settings_).throughput_samples_per_s


@settings(max_examples=25, deadline=None)
@given(_clusters, _settings)
def test_every_placement_is_valid_optimal_per_vw_and_never_beats_the_oracle(
    cluster: ClusterSpec, settings_: WaveSettings
) -> None:
    try:
        choice = choose(cluster, PROFILE, options=OPTIONS, settings=settings_)
    except PlanError:
        assert _oracle_best(cluster, settings_) == 0.0, "a placement exists but every policy refused"
        return
    by_name = {d.name: d for d in cluster.devices}
    for policy, p in choice.placements.items():
        _check_valid(p, cluster)
        for vw in p.vws:  # each VW's pipeline is the best cut over its devices
            oracle = brute_force_partition(PROFILE, [by_name[n] for n in vw.devices], None, OPTIONS)
            assert oracle is not None and math.isclose(
                vw.plan.bottleneck_s, oracle.bottleneck_s, rel_tol=1e-9
            )
        if policy == "np":
            assert sorted(vw.devices for vw in p.vws) == sorted(
                tuple(d.name for d in cluster.devices_of_node(n)) for n in cluster.nodes
            )
        if policy == "ed":
            mixes = {tuple(sorted(Counter(by_name[n].type for n in vw.devices).items())) for vw in p.vws}
            assert len(mixes) == 1 and {n for vw in p.vws for n in vw.devices} == set(cluster.names)
        # the estimate is what the formula gives for these VWs
        assert p.throughput_samples_per_s == pytest.approx(
            _estimate_of([vw.plan for vw in p.vws], cluster, settings_)
        )
    assert choice.chosen.throughput_samples_per_s == max(
        p.throughput_samples_per_s for p in choice.placements.values()
    )
    assert choice.chosen.throughput_samples_per_s <= _oracle_best(cluster, settings_) * (1 + 1e-9)


def test_flotilla_plan_prints_every_placement_and_the_choice(tmp_path: Path) -> None:
    import typer
    from typer.testing import CliRunner

    from flotilla.cli.pipeline_cmds import plan_command, profile_command

    app = typer.Typer(add_completion=False)
    app.command("plan")(plan_command)
    app.command("profile")(profile_command)
    example = Path(__file__).parents[2] / "examples" / "hetpipe.yaml"
    # the example's layers with fixed times (a profile measured here would make the choice depend
    # on this machine's load): embedding, four transformer blocks, head; bytes as measured
    block = LayerProfile(name="b", forward_s=0.006, backward_s=0.009, activation_bytes=524288,
                         param_bytes=198912, saved_bytes=7913472)  # fmt: skip
    layers = (
        LayerProfile(name="0:CharEmbedding", forward_s=0.0006, backward_s=0.0005, activation_bytes=524288,
                     param_bytes=40960, saved_bytes=0),
        *(replace(block, name=f"{i}:TransformerBlock") for i in range(1, 5)),
        LayerProfile(name="5:LMHead", forward_s=0.0014, backward_s=0.002, activation_bytes=786432,
                     param_bytes=24960, saved_bytes=1343492),
    )  # fmt: skip
    profile = tmp_path / "profile.json"
    ModelProfile(layers=layers, batch_size=32, input_bytes=16384).save(profile)
    args = ["plan", str(example), "--profile", str(profile), "--virtual-workers"]
    res = CliRunner().invoke(app, [*args, "--s-local", "3"])
    assert res.exit_code == 0, res.output
    assert "a wave is 4 minibatch(es) (s_local 3), clock distance 0" in res.output
    # (4 minibatches in flight: the strong node's two devices cannot hold them, as the weak ones cannot)
    assert "np: cannot place: node 'n0' cannot hold the model" in res.output
    assert "ed: 2 VW(s)" in res.output and "  VW 0: v0, r0, g0, q0:" in res.output
    assert "of 3.0 MiB" in res.output  # (memory per stage against the device's budget)
    assert "chosen: ed (the fastest predicted)" in res.output
    assert "a minibatch alone through the pipeline" in res.output  # (the wave's gated trip)
    assert "without virtual workers, data parallel over v0, v1, r0, r1: predicted" in res.output
    assert "without virtual workers, one pipeline over" in res.output
    res = CliRunner().invoke(app, [*args, "--placement", "np"])
    assert res.exit_code == 2 and "error: placement 'np': node 'n2' cannot hold the model" in res.output
    # without --virtual-workers: the placement the config asks for, the one `flotilla run` starts
    # (no replicated stages; the example's s_local 0)
    res = CliRunner().invoke(app, ["plan", str(example), "--profile", str(profile)])
    assert res.exit_code == 0, res.output
    assert (
        "a wave is 1 minibatch(es) (s_local 0)" in res.output
        and "chosen: ed (the fastest predicted)" in res.output
    )
    assert "flotilla run starts ed: VW 0: " in res.output
    res = CliRunner().invoke(
        app, ["plan", str(example), "--profile", str(profile), "--set", "strategy.placement=np"]
    )
    assert res.exit_code == 2 and "node 'n2' cannot hold the model" in res.output
    # a device too small for any layer: the hd VW of its node runs on the other one, and says so
    res = CliRunner().invoke(
        app, ["plan", str(example), "--profile", str(profile), "--set", "cluster.workers.0.memory_bytes=1KiB"]
    )
    assert res.exit_code == 0, res.output
    assert "  VW 0: v1 (v0 left out by its cut): 1 stage(s)" in res.output, res.output
