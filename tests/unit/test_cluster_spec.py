"""The one cluster description: construction checks, lookups, YAML and run-config forms agree,
and the partitioner plans on it exactly as on separate devices and links."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flotilla.cluster.spec import ClusterSpec, DeviceSpec, Link, LinkModel, PairLink
from flotilla.config import load_config
from flotilla.core.errors import ConfigError
from flotilla.pipeline import plan as pipeline_plan
from flotilla.pipeline.partition import partition
from flotilla.pipeline.plan import PartitionOptions, evaluate_plan
from flotilla.pipeline.profile import LayerProfile, ModelProfile
from flotilla.pipeline.split import fixed_stage_plan

GiB = 2**30

SPEC_YAML = """
devices:
  - {name: fast, type: V100, node: n0, speed: 1.0, memory_bytes: 1073741824}
  - {name: mid, type: V100, node: n0, speed: 0.5, memory_bytes: 1073741824}
  - {name: slow, type: K80, node: n1, speed: 0.25, memory_bytes: 536870912}
links:
  bandwidth_gbps: 2.0
  latency_s: 0.001
  pairs:
    - {a: fast, b: slow, bandwidth_gbps: 0.5, latency_s: 0.01}
    - {a: mid, b: fast, bandwidth_gbps: 40.0}
"""

RUN_YAML = """
cluster:
  workers:
    - {name: fast, type: V100, node: n0, speed: 1.0, memory_bytes: 1GiB}
    - {name: mid, speed: 0.5}
    - {name: slow, type: K80, node: n1, speed: 0.25, memory_bytes: 512MiB}
  defaults: {type: V100, node: n0, memory_bytes: 1GiB}
  links:
    bandwidth_gbps: 2.0
    latency_s: 0.001
    pairs:
      - {a: fast, b: slow, bandwidth_gbps: 0.5, latency_s: 0.01}
      - {a: mid, b: fast, bandwidth_gbps: 40.0}
job: {model: {name: mlp}, dataset: {name: synthetic}, steps: 5}
"""

MINIMAL = """
cluster: {num_workers: 2}
job: {model: {name: mlp}, dataset: {name: synthetic}, steps: 5}
"""


def test_yaml_spec_and_run_config_give_equal_specs() -> None:
    from_yaml = ClusterSpec.from_yaml_text(SPEC_YAML)
    from_config = load_config(None, (), text=RUN_YAML).cluster.spec()
    assert from_yaml == from_config
    assert from_yaml.names == ("fast", "mid", "slow")
    assert from_yaml.device("slow") == DeviceSpec(
        name="slow", type="K80", node="n1", speed=0.25, memory_bytes=GiB // 2
    )
    assert ClusterSpec.from_mapping(from_yaml.to_mapping()) == from_yaml


def test_lookups_are_symmetric_and_fall_back_to_defaults() -> None:
    spec = ClusterSpec.from_yaml_text(SPEC_YAML)
    assert spec.link("fast", "slow") == spec.link("slow", "fast") == Link(bandwidth_gbps=0.5, latency_s=0.01)
    assert spec.link("fast", "mid") == Link(bandwidth_gbps=40.0, latency_s=0.001)  # default latency
    assert spec.link("mid", "slow") == Link(bandwidth_gbps=2.0, latency_s=0.001)
    assert spec.nodes == ("n0", "n1")
    assert [d.name for d in spec.devices_of_node("n0")] == ["fast", "mid"]
    assert spec.devices_of_node("n9") == ()
    with pytest.raises(ConfigError, match=r"unknown device 'gpu7'; devices are \['fast', 'mid', 'slow'\]"):
        spec.device("gpu7")
    with pytest.raises(ConfigError, match="unknown device 'x'"):
        spec.link("fast", "x")


def test_run_config_defaults_give_the_old_pipeline_devices() -> None:
    cfg = load_config(None, (), text=MINIMAL)
    spec = cfg.cluster.spec()
    assert spec.devices == (
        DeviceSpec(name="w0", type="cpu", node="local", speed=1.0, memory_bytes=8 * GiB),
        DeviceSpec(name="w1", type="cpu", node="local", speed=1.0, memory_bytes=8 * GiB),
    )
    assert spec.links == LinkModel()  # what the pipeline launcher used before links were configurable


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: DeviceSpec(name="", memory_bytes=1), "DeviceSpec.name must be a non-empty string"),
        (
            lambda: DeviceSpec(name="a", speed=0, memory_bytes=1),
            "DeviceSpec.speed must be a finite number > 0",
        ),
        (lambda: DeviceSpec(name="a", memory_bytes=0), "DeviceSpec.memory_bytes must be an integer > 0"),
        (lambda: DeviceSpec(name="a", node="", memory_bytes=1), "DeviceSpec.node must be a non-empty string"),
        (lambda: PairLink(a="a", b="a", bandwidth_gbps=1.0), "PairLink needs two different devices"),
        (lambda: PairLink(a="a", b="b", bandwidth_gbps=-1.0), "PairLink.bandwidth_gbps must be a finite"),
        (lambda: LinkModel(latency_s=-1.0), "LinkModel.latency_s must be a finite number >= 0"),
        (
            lambda: LinkModel(
                pairs=(PairLink(a="a", b="b", bandwidth_gbps=1), PairLink(a="b", b="a", bandwidth_gbps=2))
            ),
            "LinkModel.pairs lists the link b-a twice",
        ),
        (lambda: ClusterSpec(devices=()), "ClusterSpec.devices must name at least one device"),
        (
            lambda: ClusterSpec(devices=(DeviceSpec(name="a", memory_bytes=1),) * 2),
            r"device names must be unique, repeated \['a'\]",
        ),
        (
            lambda: ClusterSpec(
                devices=(DeviceSpec(name="a", memory_bytes=1),),
                links=LinkModel(pairs=(PairLink(a="a", b="zz", bandwidth_gbps=1),)),
            ),
            r"LinkModel.pairs name unknown device\(s\) \['zz'\]",
        ),
    ],
)
def test_invalid_specs_are_refused_naming_the_field(make: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make()  # type: ignore[operator]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "devices: [{name: a, memory_bytes: 1, sped: 2}]",
            r"devices\[0\]: unknown key\(s\) \['sped'\]; allowed",
        ),
        ("devices: [{name: a}]", r"devices\[0\] lacks required key\(s\) \['memory_bytes'\]"),
        ("devices: {a: 1}", "devices must be a list of mappings"),
        (
            "devices: [{name: a, memory_bytes: 1}]\nlinks: {pairs: [{a: a}]}",
            r"lacks required key\(s\) \['b', 'bandwidth_gbps'\]",
        ),
        ("devices: [{name: a, memory_bytes: 1}]\nlinks: {bw: 1}", r"links: unknown key\(s\) \['bw'\]"),
        ("- a\n- b\n", "expected a mapping with devices/links, got list"),
        ("devices: [", "not valid YAML"),
        ("nodes: 3", r"unknown key\(s\) \['nodes'\]; allowed: \['devices', 'links'\]"),
    ],
)
def test_bad_yaml_is_refused_with_one_clear_message(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ClusterSpec.from_yaml_text(text)


def _profile(num_layers: int) -> ModelProfile:
    layers = tuple(
        LayerProfile(
            name=f"l{i}",
            forward_s=0.01 * (1 + i % 3),
            backward_s=0.02 * (1 + i % 2),
            activation_bytes=4096 * (1 + i),
            param_bytes=10_000 * (1 + i % 4),
        )
        for i in range(num_layers)
    )
    return ModelProfile(batch_size=8, input_bytes=1024, layers=layers)


@given(bandwidth=st.sampled_from([1e-5, 1e-3, 1.0]), seed=st.integers(0, 3))
def test_partitioner_plans_a_cluster_spec_like_its_parts(bandwidth: float, seed: int) -> None:
    spec = ClusterSpec.from_yaml_text(SPEC_YAML)
    spec = ClusterSpec(
        devices=spec.devices,
        links=LinkModel(default_bandwidth_gbps=bandwidth, latency_s=0.001 * seed, pairs=spec.links.pairs),
    )
    profile, opts = _profile(5), PartitionOptions()
    assert partition(profile, spec, options=opts) == partition(profile, list(spec.devices), spec.links, opts)
    assert fixed_stage_plan(profile, spec, options=opts) == fixed_stage_plan(
        profile, list(spec.devices), spec.links, opts
    )
    groups = [["fast"], ["mid", "slow"]]
    assert evaluate_plan(profile, spec, None, opts, [2, 5], groups) == evaluate_plan(
        profile, spec.devices, spec.links, opts, [2, 5], groups
    )


def test_old_pipeline_names_are_aliases_of_the_cluster_spec() -> None:
    assert pipeline_plan.DeviceSpec is DeviceSpec
    assert pipeline_plan.LinkModel is LinkModel
    assert pipeline_plan.PairLink is PairLink
    spec = ClusterSpec(devices=(DeviceSpec(name="a", memory_bytes=GiB),))
    with pytest.raises(ConfigError, match="links must be None when a ClusterSpec is given"):
        partition(_profile(2), spec, LinkModel())
