"""Profiles and the heterogeneous PipeDream partitioner (flotilla.pipeline.profile / plan / partition).

The DP is checked against ``brute_force_partition`` (every split and device assignment) on small
random instances, including memory limits, replication, pair links and every schedule kind.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.core.errors import ConfigError
from flotilla.pipeline.partition import (
    DeviceSpec,
    LinkModel,
    PairLink,
    PartitionOptions,
    PlanError,
    brute_force_partition,
    device_classes,
    evaluate_plan,
    format_plan,
    partition,
)
from flotilla.pipeline.plan import format_bytes, memory_shortfalls
from flotilla.pipeline.profile import LayerProfile, ModelProfile, load_profile
from flotilla.pipeline.schedule import ScheduleKind

GIB = 2**30


def _profile(times: list[float], act: list[int], params: list[int]) -> ModelProfile:
    layers = tuple(
        LayerProfile(name=f"l{i}", forward_s=t / 3, backward_s=2 * t / 3, activation_bytes=a, param_bytes=w)
        for i, (t, a, w) in enumerate(zip(times, act, params))
    )
    return ModelProfile(layers=layers, batch_size=8, input_bytes=100)


# ---------------------------------------------------------------- profile files


def test_profile_roundtrip(tmp_path) -> None:
    prof = _profile([1.0, 2.5, 0.5], [10, 20, 30], [1000, 0, 7])
    path = prof.save(tmp_path / "sub" / "p.json")
    assert load_profile(path) == prof
    assert ModelProfile.from_dict(json.loads(path.read_text())) == prof
    assert prof.total_param_bytes == 1007 and prof.total_compute_s == pytest.approx(4.0)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["layers"][1].__setitem__("forward_s", -1), r"layer 'l1': forward_s must be a finite"),
        (
            lambda d: d["layers"][0].pop("param_bytes"),
            r"layers\[0\] is missing required field\(s\) \['param_bytes'\]",
        ),
        (lambda d: d.__setitem__("extra", 1), r"unknown field\(s\) \['extra'\]"),
        (lambda d: d.__setitem__("format_version", 9), r"format_version must be 1"),
        (lambda d: d.__setitem__("batch_size", 0), r"batch_size must be an integer >= 1"),
        (lambda d: d["layers"][2].__setitem__("name", "l0"), r"names must be unique"),
        (
            lambda d: d["layers"][2].__setitem__("activation_bytes", 1.5),
            r"activation_bytes must be an integer",
        ),
    ],
)
def test_profile_load_rejects_bad_files(tmp_path, mutate, message) -> None:
    data = _profile([1.0, 2.0, 3.0], [1, 2, 3], [4, 5, 6]).to_dict()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=message) as info:
        load_profile(path)
    assert str(path) in str(info.value)


def test_profile_load_bad_json_and_missing_file(tmp_path) -> None:
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_profile(tmp_path / "x.json")
    with pytest.raises(ConfigError, match="cannot read profile file"):
        load_profile(tmp_path / "missing.json")


# ---------------------------------------------------------------- DP vs brute force

SPEEDS = st.sampled_from([0.5, 1.0, 2.0])
MEMORY = st.sampled_from([400, 900, 2500, 10**9])


@st.composite
def instances(draw: st.DrawFn):
    num_layers = draw(st.integers(1, 7))
    times = draw(st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=num_layers, max_size=num_layers))
    act = draw(st.lists(st.integers(0, 200), min_size=num_layers, max_size=num_layers))
    params = draw(st.lists(st.integers(0, 200), min_size=num_layers, max_size=num_layers))
    n = draw(st.integers(1, 3))
    devices = [DeviceSpec(name=f"gpu{i}", speed=draw(SPEEDS), memory_bytes=draw(MEMORY)) for i in range(n)]
    pairs = ()
    if n >= 2 and draw(st.booleans()):
        pairs = (
            PairLink(
                a="gpu0",
                b="gpu1",
                bandwidth_gbps=draw(st.sampled_from([1e-7, 1e-6])),
                latency_s=draw(st.sampled_from([None, 0.5])),
            ),
        )
    links = LinkModel(default_bandwidth_gbps=draw(st.sampled_from([1e-6, 1e-5])), latency_s=0.01, pairs=pairs)
    kind = draw(st.sampled_from(list(ScheduleKind)))
    options = PartitionOptions(
        schedule=kind,
        num_microbatches=1 if kind is ScheduleKind.PIPEDREAM else draw(st.integers(1, 4)),
        vertical_sync=kind is ScheduleKind.PIPEDREAM and draw(st.booleans()),
        allow_replication=draw(st.booleans()),
        optimizer_multiplier=draw(st.sampled_from([1.0, 3.0])),
        overlap_comm=draw(st.booleans()),
    )
    return _profile(times, act, params), devices, links, options


def _check_structure(plan, profile, devices) -> None:
    covered = [layer for s in plan.stages for layer in range(s.layer_start, s.layer_end)]
    assert covered == list(range(profile.num_layers))  # every layer once, in order, contiguous
    assert all(s.layer_start < s.layer_end for s in plan.stages)
    assert [s.stage_idx for s in plan.stages] == list(range(plan.num_stages))
    used = [d for s in plan.stages for d in s.devices]
    assert len(used) == len(set(used)) and set(used) | set(plan.unused_devices) == {d.name for d in devices}
    assert memory_shortfalls(plan, devices) == []
    assert plan.bottleneck_s == max(s.stage_s for s in plan.stages)


@settings(max_examples=100, deadline=None)
@given(instances())
def test_dp_matches_brute_force(instance) -> None:
    profile, devices, links, options = instance
    expected = brute_force_partition(profile, devices, links, options)
    if expected is None:
        with pytest.raises(PlanError, match=r"short by .* \(\d+ bytes\)"):
            partition(profile, devices, links, options)
        return
    plan = partition(profile, devices, links, options)
    _check_structure(plan, profile, devices)
    assert plan.bottleneck_s == pytest.approx(expected.bottleneck_s, rel=1e-9, abs=1e-12)
    if not options.allow_replication:
        assert all(len(s.devices) == 1 for s in plan.stages)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 12), st.booleans())
def test_faster_device_gets_more_layers(num_layers: int, replicate: bool) -> None:
    profile = ModelProfile.uniform(num_layers, forward_s=1.0, backward_s=2.0, activation_bytes=1000)
    devices = [
        DeviceSpec(name="slow", speed=0.5, memory_bytes=GIB),
        DeviceSpec(name="fast", speed=1.0, memory_bytes=GIB),
    ]
    plan = partition(profile, devices, options=PartitionOptions(allow_replication=replicate))
    layers = {d: 0 for d in ("slow", "fast")}
    for stage in plan.stages:
        for d in stage.devices:
            layers[d] += (stage.layer_end - stage.layer_start) / len(stage.devices)
    assert layers["fast"] >= layers["slow"]
    if num_layers >= 3:  # splitting 2:1 beats the fast device alone
        assert plan.num_stages == 2 and layers["fast"] > layers["slow"] > 0


def test_replication_and_slow_link_choices() -> None:
    # One heavy layer dominates: replicating it over two devices halves the bottleneck.
    profile = _profile([1.0, 12.0, 1.0], [10, 10, 10], [0, 0, 0])
    devices = [DeviceSpec(name=f"g{i}", memory_bytes=GIB) for i in range(4)]
    plan = partition(profile, devices)
    heavy = next(s for s in plan.stages if s.layer_start <= 1 < s.layer_end)
    assert len(heavy.devices) >= 2 and plan.bottleneck_s < 12.0
    # A link so slow that any cut costs more than running everything on one device.
    slow = LinkModel(default_bandwidth_gbps=1e-9)
    single = partition(profile, devices, slow, PartitionOptions(allow_replication=False))
    assert single.num_stages == 1 and single.bottleneck_s == pytest.approx(14.0)


def test_memory_refusal_names_device_and_shortfall() -> None:
    profile = ModelProfile.uniform(8, param_bytes=GIB)
    opts = PartitionOptions(schedule=ScheduleKind.GPIPE, optimizer_multiplier=1.0)
    with pytest.raises(PlanError) as info:
        partition(profile, [DeviceSpec(name="gpu0", memory_bytes=2 * GIB)], options=opts)
    assert (
        "device gpu0 needs 8.0 GiB for stage 0 (layers 0-7) but has 2.0 GiB: "
        "short by 6.0 GiB (6442450944 bytes)"
    ) in str(info.value)
    assert isinstance(info.value, ConfigError)
    # Two devices, pipedream stashing: the best attempt leaves gpu1 short by exactly 0.5 GiB.
    # Stage 0 of 2 holds 2 versions: gpu1 (3.5 GiB) on layers 0-1 needs 4 GiB, gpu0 (6 GiB) holds 2-7.
    devices = [
        DeviceSpec(name="gpu0", memory_bytes=6 * GIB),
        DeviceSpec(name="gpu1", memory_bytes=7 * GIB // 2),
    ]
    opts = PartitionOptions(optimizer_multiplier=1.0, allow_replication=False)
    with pytest.raises(PlanError) as info:
        partition(profile, devices, options=opts)
    match = re.search(
        r"device gpu1 needs 4\.0 GiB for stage (\d) \(layers (\d)-(\d)\) but has 3\.5 GiB: "
        r"short by 512\.0 MiB \((\d+) bytes\)",
        str(info.value),
    )
    assert match and match.groups() == ("0", "0", "1", str(GIB // 2))
    assert "gpu0" not in str(info.value).split("closest to fitting")[1]  # gpu0 fits its stage


def test_memory_model_per_schedule() -> None:
    profile = _profile([1.0] * 4, [100] * 4, [1000] * 4)
    devices = [DeviceSpec(name=f"g{i}", memory_bytes=GIB) for i in range(2)]

    def memory(**kw) -> list[int]:
        plan = evaluate_plan(
            profile,
            devices,
            LinkModel(),
            PartitionOptions(optimizer_multiplier=2.0, **kw),
            [2, 4],
            [["g0"], ["g1"]],
        )
        return [s.memory_bytes for s in plan.stages]

    # stage 0: params 2000 (+100 input + 200 outputs); stage 1: params 2000, activations 300.
    assert memory(schedule=ScheduleKind.GPIPE, num_microbatches=4) == [4000 + 300, 4000 + 300]
    assert memory(schedule=ScheduleKind.ONE_F_ONE_B, num_microbatches=4) == [4000 + 150, 4000 + 75]
    assert memory() == [6000 + 600, 4000 + 300]  # pipedream: stage 0 stashes 2 versions, 2 in flight
    assert memory(vertical_sync=True) == [6000 + 600, 6000 + 300]
    # HetPipe's depth N = s_local + 1: stage i keeps max(1, N - i) minibatches and weight versions
    assert memory(in_flight=1) == [4000 + 300, 4000 + 300]  # (s_local 0: one at a time)
    assert memory(in_flight=4) == [10000 + 1200, 8000 + 900]
    with pytest.raises(ConfigError, match="in_flight must be an integer >= 1"):
        PartitionOptions(in_flight=0)


def test_device_classes_follow_links() -> None:
    devices = [DeviceSpec(name=n, memory_bytes=GIB) for n in ("a", "b", "c", "d")]
    assert device_classes(devices, LinkModel()) == [(0, 1, 2, 3)]
    # a-b is a fast intra-node link: a and b are interchangeable, so are c and d, but not a and c.
    links = LinkModel(
        pairs=(PairLink(a="a", b="b", bandwidth_gbps=100.0), PairLink(a="c", b="d", bandwidth_gbps=100.0))
    )
    assert device_classes(devices, links) == [(0, 1), (2, 3)]
    slower = [*devices[:3], DeviceSpec(name="d", speed=0.5, memory_bytes=GIB)]
    assert device_classes(slower, LinkModel()) == [(0, 1, 2), (3,)]


def test_format_plan_and_to_dict() -> None:
    profile = ModelProfile.uniform(6, activation_bytes=1000, param_bytes=10**6, batch_size=32)
    devices = [
        DeviceSpec(name="gpu0", memory_bytes=GIB),
        DeviceSpec(name="gpu1", speed=0.5, memory_bytes=GIB),
    ]
    plan = partition(
        profile, devices, options=PartitionOptions(schedule=ScheduleKind.ONE_F_ONE_B, num_microbatches=4)
    )
    text = format_plan(plan)
    assert text.splitlines()[0].split() == [
        "stage",
        "layers",
        "devices",
        "compute_s",
        "allreduce_s",
        "comm_s",
        "stage_s",
        "memory/device",
    ]
    assert f"bottleneck: stage {plan.bottleneck_stage}" in text and "samples/s" in text
    rows = {line.split()[2]: line.split()[1] for line in text.splitlines()[1:3]}
    assert sorted(rows.values()) == ["0-1", "2-5"] or sorted(rows.values()) == ["0-3", "4-5"]
    fast = next(s for s in plan.stages if s.devices == ("gpu0",))
    assert rows["gpu0"] == fast.layers_label and fast.layer_end - fast.layer_start == 4
    m, p = 4, plan.num_stages
    assert plan.predicted_step_s == pytest.approx((plan.total_stage_s + (m - 1) * plan.bottleneck_s) / m)
    assert plan.throughput_samples_per_s == pytest.approx(32 / plan.predicted_step_s)
    assert json.loads(json.dumps(plan.to_dict()))["stages"][0]["devices"] == list(plan.stages[0].devices)
    assert p == 2 and format_bytes(3 * GIB // 2) == "1.5 GiB" and format_bytes(17) == "17 B"


def test_input_validation() -> None:
    profile = ModelProfile.uniform(3)
    dev = DeviceSpec(name="g0", memory_bytes=GIB)
    with pytest.raises(ConfigError, match="DeviceSpec.speed must be a finite number > 0"):
        DeviceSpec(name="x", speed=0, memory_bytes=1)
    with pytest.raises(ConfigError, match="names must be unique"):
        partition(profile, [dev, dev])
    with pytest.raises(ConfigError, match="unknown device"):
        partition(profile, [dev], LinkModel(pairs=(PairLink(a="g0", b="zz", bandwidth_gbps=1.0),)))
    with pytest.raises(ConfigError, match="num_microbatches must be 1 for schedule 'pipedream'"):
        PartitionOptions(num_microbatches=4)
    with pytest.raises(ConfigError, match="strictly increasing"):
        evaluate_plan(profile, [dev], LinkModel(), PartitionOptions(), [0, 3], [["g0"], ["g0"]])
    many = [DeviceSpec(name=f"g{i}", speed=1.0 + i, memory_bytes=GIB) for i in range(6)]
    with pytest.raises(ConfigError, match="max_search_work"):
        partition(ModelProfile.uniform(40), many, options=PartitionOptions(max_search_work=1000))
