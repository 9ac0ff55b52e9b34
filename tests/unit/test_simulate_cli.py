"""``flotilla simulate``: the comparison of strategies on a scaled cluster (``cli/simulate_cmd.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flotilla.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "demo.yaml"


def test_it_compares_strategies_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    kinds = "allreduce,diloco,ps,partial_reduce,adpsgd"
    args = ["simulate", str(DEMO), "--strategies", kinds, "--num-workers", "64"]
    args += ["--step-s", "0.01", "--price", "cpu=2.0", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (
        "= 64 devices" in result.output and "10.00 ms per step on a speed-1 device (given)" in result.output
    )
    rows = {r["strategy"]: r for r in json.loads(out.read_text())["rows"]}
    for kind in ("allreduce", "diloco", "ps", "partial_reduce", "adpsgd"):
        r = rows[kind]
        assert r["completed"] and r["steps"] > 0 and r["time_s"] > 0, r
        assert r["cost"] == pytest.approx(r["device_hours"] * 2.0, rel=1e-3)  # (every class priced at 2.0)
    # DiLoCo reduces once per 10 steps: never slower than all-reduce on the same cluster
    assert rows["diloco"]["time_s"] <= rows["allreduce"]["time_s"]


def test_a_strategy_without_a_simulated_hook_gets_a_row_saying_so(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    own = ROOT / "examples" / "own_strategy" / "averaged.yaml"  # (a user's strategy: no hook)
    result = CliRunner().invoke(app, ["simulate", str(own), "--step-s", "0.01", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "not simulated yet (its spec has no `simulated` hook)" in result.output
    assert "no strategy completed the job" in result.output
    (row,) = json.loads(out.read_text())["rows"]
    assert row["simulated"] is False and row["strategy"].endswith("averaged.py:SPEC"), row


def test_a_spot_trace_revokes_and_brings_back_groups_of_devices(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("0,add,a\n0,add,b\n2000,remove,a\n4000,add,c\n")
    args = ["simulate", str(DEMO), "--strategies", "allreduce", "--num-workers", "8", "--step-s", "0.01"]
    result = CliRunner().invoke(app, [*args, "--trace", str(trace), "--time-scale", "1"])
    assert result.exit_code == 0, result.output
    assert "t.csv x1, 8 device changes, 4 device(s) per trace node" in result.output
    assert " 1 recoveries" in result.output


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--price", "cpu"], "error: --price: expected TYPE=USD_PER_DEVICE_HOUR"),
        (["--price", "gpu=1"], "error: --price: no worker has type 'gpu'"),
        (["--num-workers", "1"], "error: --num-workers: at least one per device class"),
        (["--step-s", "0"], "error: --step-s: must be > 0"),
        (["--strategies", "nope"], "error: strategy.kind: unknown 'nope'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(extra: list[str], expected: str) -> None:
    result = CliRunner().invoke(app, ["simulate", str(DEMO), *extra])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1].startswith(expected), result.output


SIZING = ROOT / "examples" / "sizing_1024.yaml"


def test_a_sizing_file_compares_strategies_with_costs_and_writes_plots(tmp_path: Path) -> None:
    out, plots = tmp_path / "sim.json", tmp_path / "plots"
    args = ["simulate", str(SIZING), "--num-workers", "32", "--strategies", "allreduce,diloco,adpsgd"]
    result = CliRunner().invoke(app, [*args, "--json", str(out), "--plots", str(plots)])
    assert result.exit_code == 0, result.output
    assert "model transformer-1.3b" in result.output and "= 32 devices" in result.output
    assert "16 x a100-40gb (speed 1), 16 x v100-32gb (speed 0.401)" in result.output
    assert "aws-p3-spot.csv x1" in result.output
    body = json.loads(out.read_text())
    rows = {r["strategy"]: r for r in body["rows"]}
    assert set(rows) == {"allreduce", "diloco", "adpsgd"}
    fastest = min(rows.values(), key=lambda r: r["time_s"])
    assert f"first to finish: {fastest['strategy']} in" in result.output
    for r in rows.values():
        assert r["completed"] and r["cost"] > 0 and r["device_hours"] > 0
    # the file's DiLoCo settings (inner_steps: 50) were kept when --strategies named the kind
    assert rows["diloco"]["time_s"] != rows["allreduce"]["time_s"]
    for name in ("sim_throughput.png", "sim_membership.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("text", "extra", "expected"),
    [
        ("simulate: {model: transformer-1.3b}", [], "simulate.batch_per_worker: Field required"),
        (None, ["--step-s", "1"], "error: --step-s and --calibration apply to a training config"),
        (None, ["--set", "simulate.mfu=2"], "simulate.mfu: Input should be less than or equal to 1"),
        (None, ["--price", "h100-80gb=3"], "error: --price: no device has type 'h100-80gb'"),
        ("simulate: [", [], "not YAML"),
    ],
)
def test_a_bad_sizing_file_is_one_line_and_exit_2(
    tmp_path: Path, text: str | None, extra: list[str], expected: str
) -> None:
    path = SIZING
    if text is not None:
        path = tmp_path / "s.yaml"
        path.write_text(text)
    result = CliRunner().invoke(app, ["simulate", str(path), *extra])
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: ") and expected in last, result.output


def test_an_emulated_class_runs_at_the_speed_its_devices_reach_here() -> None:
    """The emulator stretches the compute it measures; a step after a sleep is slower than in a
    tight loop, so an emulated device of speed s runs at s x warm / cold (never faster than s).
    Devices of speed 1 never sleep and are not measured."""
    from flotilla.cli.simulate_measure import EMULATED_REPEATS, emulated_speeds

    calls: list[int] = []

    def cold_step() -> float:
        calls.append(1)
        return 1.5e-3  # (every timed step after a sleep)

    assert emulated_speeds(cold_step, [1.0, 0.25, 0.25], warm_s=1.2e-3) == pytest.approx({0.25: 0.2})
    assert len(calls) == EMULATED_REPEATS  # (one class measured, once)
    assert emulated_speeds(lambda: 1.0e-3, [0.5], warm_s=1.2e-3) == {0.5: 0.5}  # (never above s)
    assert emulated_speeds(cold_step, [1.0], warm_s=1.2e-3) == {}


def test_a_pipeline_jobs_layers_each_get_their_optimizer_step_measured() -> None:
    from flotilla.cli.simulate_measure import optimizer_per_layer
    from flotilla.config.load import load_config
    from flotilla.trainer.pipeline_setup import pipeline_parts

    cfg = load_config(ROOT / "examples" / "pipeline_lm.yaml")
    model = pipeline_parts(cfg).model
    updates = optimizer_per_layer(cfg, repeats=3)
    assert len(updates) == len(model)
    for layer, t in zip(model, updates):
        has_params = any(p.requires_grad for p in layer.parameters())
        assert (t > 0) == has_params, (layer, t)


def test_emulated_links_are_the_simulated_links_even_with_a_calibration(tmp_path: Path) -> None:
    """``cluster.links.emulate``: the job runs over its emulated links (comm/shaping.py), so the
    simulator takes them for the job's links; a calibration then gives only the message plane's
    own cost (which the runtime adds on top of the emulated link).  Without emulation the
    calibrated link is the job's."""
    from flotilla.cli.simulate_inputs import load_inputs
    from flotilla.cluster.spec import Link

    calibration = tmp_path / "cal.json"
    calibration.write_text(
        json.dumps(
            {
                "allreduce_link": {"bandwidth_gbps": 3.0, "latency_s": 1e-4},
                "msgplane_cost": {"bandwidth_gbps": 8.0, "latency_s": 2e-4},
                "world_size": 2,
            }
        )
    )
    links = ["cluster.links.bandwidth_gbps=0.25", "cluster.links.latency_s=0.004"]

    def cluster(*sets: str):  # -> SimCluster
        return load_inputs(
            ROOT / "examples" / "tiny.yaml", [*links, *sets], num_workers=None, trace=None,
            time_scale=None, step_s=0.01, prices={}, calibration=calibration,
        ).cluster  # fmt: skip

    emulated, calibrated = cluster("cluster.links.emulate=true"), cluster()
    assert emulated.intra_node == emulated.inter_node == Link(bandwidth_gbps=0.25, latency_s=0.004)
    assert calibrated.intra_node == calibrated.inter_node == Link(bandwidth_gbps=3.0, latency_s=1e-4)
    assert emulated.message_plane == calibrated.message_plane == Link(bandwidth_gbps=8.0, latency_s=2e-4)


def test_the_configured_pairs_become_the_simulated_links_within_and_between_nodes() -> None:
    """``cli/simulate_cluster.node_links``: each of the simulator's two links is the slowest of
    its kind among the configured pairs, an unnamed pair taking the defaults."""
    from flotilla.cli.simulate_cluster import node_links
    from flotilla.cluster.spec import ClusterSpec, Link

    def spec(pairs: list[dict]) -> ClusterSpec:
        devices = [
            {"name": n, "type": "cpu", "node": node, "speed": 1.0, "memory_bytes": 2**30}
            for n, node in (("a0", "n0"), ("a1", "n0"), ("b0", "n1"), ("b1", "n1"))
        ]
        return ClusterSpec.from_mapping(
            {"devices": devices, "links": {"bandwidth_gbps": 1.0, "latency_s": 0.002, "pairs": pairs}}
        )

    fast = [{"a": "a0", "b": "a1", "bandwidth_gbps": 40.0, "latency_s": 0.0}]
    fast += [{"a": "b0", "b": "b1", "bandwidth_gbps": 20.0, "latency_s": 0.0001}]
    intra, inter = node_links(spec(fast))
    assert intra == Link(bandwidth_gbps=20.0, latency_s=0.0001)  # (every pair in a node named)
    assert inter == Link(bandwidth_gbps=1.0, latency_s=0.002)  # (the defaults)
    # one node's pair left to the defaults: the slowest within a node is the default link
    intra, _ = node_links(spec(fast[:1]))
    assert intra == Link(bandwidth_gbps=1.0, latency_s=0.002)
    # one slow pair between nodes: the simulated link between nodes is that one
    slow = fast + [{"a": "a0", "b": "b0", "bandwidth_gbps": 0.1}]
    assert node_links(spec(slow))[1] == Link(bandwidth_gbps=0.1, latency_s=0.002)


def test_set_changes_a_sizing_file_as_it_does_a_training_config() -> None:
    """``--set`` on a sizing file (refused before): the same grammar, the sizing schema checks it."""
    args = ["simulate", str(SIZING), "--set", "simulate.steps=5", "--set", "simulate.trace=null"]
    one = CliRunner().invoke(app, [*args, "--set", "simulate.strategies=[allreduce]"])
    two = CliRunner().invoke(app, [*args, "--set", "simulate.strategies=[allreduce]",
                                   "--set", "simulate.devices.0.count=8"])  # fmt: skip
    assert one.exit_code == 0 and two.exit_code == 0, (one.output, two.output)
    costs = [ln for r in (one, two) for ln in r.output.splitlines() if ln.startswith("first to finish:")]
    assert costs[0] != costs[1] and all(c.startswith("first to finish: allreduce") for c in costs), costs
