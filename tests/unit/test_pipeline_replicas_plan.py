"""Pipeline instances side by side (``strategy.replicas``): where each stage process runs, the
devices the one split is planned over, each instance's part of every batch, and the refusals of
``flotilla validate`` (no process is started here)."""

from __future__ import annotations

import numpy as np
import pytest

from flotilla.cluster.spec import ClusterSpec, DeviceSpec, LinkModel, PairLink
from flotilla.config import load_config
from flotilla.core.errors import ConfigError
from flotilla.data.sampler import GlobalBatchSampler
from flotilla.pipeline.layout import Layout
from flotilla.pipeline.replicas import (
    Generation,
    generation_key,
    joined,
    joined_key,
    lead_of,
    plan_key,
    planning_cluster,
    ready_key,
    stage_place,
    survivors_after,
)
from flotilla.trainer.pipeline_setup import BatchData, pipeline_cluster

GIB = 1 << 30

CONFIG = """
cluster:
  workers:
    - {name: a0, speed: 1.0, memory_bytes: 4GiB}
    - {name: a1, speed: 0.5, memory_bytes: 2GiB}
    - {name: b0, speed: 0.8, memory_bytes: 8GiB}
    - {name: b1, speed: 1.0, memory_bytes: 1GiB}
job:
  model: {name: char_transformer, width: 32}
  dataset: {name: pysource, num_samples: 600, test_fraction: 0.2}
  batch_size: 16
  steps: 4
strategy: {kind: pipeline, schedule: 1f1b, num_stages: 2, num_microbatches: 4, replicas: 2}
"""


def test_process_g_is_stage_g_mod_p_of_instance_g_div_p() -> None:
    places = [stage_place(g, 3, 2) for g in range(6)]
    assert [(s.stage, s.replica) for s in places] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    with pytest.raises(
        ConfigError, match="stage process 6 out of range: .* 2 instance\\(s\\) of 3 stage\\(s\\)"
    ):
        stage_place(6, 3, 2)


def test_instances_of_different_stage_counts_number_their_processes_instance_by_instance() -> None:
    layout = Layout((2, 3, 1))
    places = [layout.place(g) for g in range(layout.num_processes)]
    assert [(s.replica, s.stage) for s in places] == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, 0)]
    assert list(layout.processes(1)) == [2, 3, 4] and layout.first(2) == 5 and not layout.is_uniform
    assert layout.describe(4, "abcdef") == "e (stage 2 of instance 1)"
    with pytest.raises(ConfigError, match="stage process 6 out of range: .* 3 instance\\(s\\) of 2/3/1"):
        layout.place(6)
    with pytest.raises(ConfigError, match="instances of >= 1 stage"):
        Layout((2, 0))


def test_the_split_is_planned_over_the_weakest_device_and_link_of_each_position() -> None:
    devices = tuple(
        DeviceSpec(name=n, speed=s, memory_bytes=m * GIB)
        for n, s, m in [("a0", 1.0, 4), ("a1", 0.5, 2), ("b0", 0.8, 8), ("b1", 1.0, 1)]
    )
    links = LinkModel(
        default_bandwidth_gbps=10.0,
        latency_s=0.001,
        pairs=(PairLink(a="b0", b="b1", bandwidth_gbps=1.0, latency_s=0.005),),
    )
    cluster = ClusterSpec(devices=devices, links=links)
    plan = planning_cluster(cluster, 2, 2)
    assert [(d.name, d.speed, d.memory_bytes) for d in plan.devices] == [
        ("a0", 0.8, 4 * GIB),
        ("a1", 0.5, GIB),
    ]
    link = plan.links.link("a0", "a1")  # instance 1's slower link between its stages 0 and 1
    assert (link.bandwidth_gbps, link.latency_s) == (1.0, 0.005)
    assert planning_cluster(cluster, 4, 1) is cluster  # one instance: the cluster itself
    with pytest.raises(ConfigError, match=r"num_stages x strategy.replicas \(3 x 2 = 6\) .* workers \(4\)"):
        planning_cluster(cluster, 3, 2)


def test_the_run_config_plans_over_the_positions(tmp_path) -> None:
    path = tmp_path / "pp.yaml"
    path.write_text(CONFIG)
    cluster = pipeline_cluster(load_config(path))
    assert [(d.name, d.speed, d.memory_bytes) for d in cluster.devices] == [
        ("a0", 0.8, 4 * GIB),
        ("a1", 0.5, GIB),
    ]


@pytest.mark.parametrize("batch", [16, 14])  # (14: instances of 7 samples, microbatches of 2 and 1)
def test_the_instances_microbatches_cover_every_global_batch_once_in_order(batch: int) -> None:
    sampler = GlobalBatchSampler(num_samples=100, global_batch_size=batch, seed=3, drop_last=True)
    m, replicas = 3, 2
    parts = [BatchData(None, sampler, m, first_step=2, replica=r, replicas=replicas) for r in range(replicas)]  # type: ignore[arg-type]
    for k in range(3):
        rows = np.concatenate([d.indices(k * m + j) for d in parts for j in range(m)])
        np.testing.assert_array_equal(rows, sampler.global_batch(2 + k))
        scales = [d.loss_scale(k * m + j) for d in parts for j in range(m)]
        assert sum(scales) == pytest.approx(1.0)  # each microbatch's share of the GLOBAL batch
        assert [d.batch_size(k * m + j) for d in parts for j in range(m)] == [
            len(d.indices(k * m + j)) for d in parts for j in range(m)
        ]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("strategy.schedule=pipedream", "strategy.replicas: must be 1 with schedule pipedream"),
        (
            "strategy.num_microbatches=9",
            "strategy.num_microbatches: must be <= each instance's share of "
            "job.batch_size \\(16 over 2 replicas = 8\\), got 9",
        ),  # fmt: skip
        (
            "strategy.replicas=3",
            "strategy.replicas: num_stages x replicas \\(2 x 3 = 6\\) must equal the "
            "number of cluster workers \\(4\\)",
        ),  # fmt: skip
    ],
)
def test_validate_refuses_what_the_instances_cannot_run(tmp_path, override: str, message: str) -> None:
    path = tmp_path / "pp.yaml"
    path.write_text(CONFIG)
    load_config(path)  # (the file itself is valid)
    with pytest.raises(ConfigError, match=message):
        load_config(path, [override])


def test_losing_an_instance_leaves_the_others_and_the_lowest_survivor_leads() -> None:
    start = Generation(1, (0, 1, 2))
    assert lead_of(start) == 0
    nxt = survivors_after(start, 2)  # (instance 2 lost)
    assert nxt == Generation(2, (0, 1))
    again = survivors_after(nxt, 2)  # (instance 2's other stage: already out)
    assert again is nxt
    alone = survivors_after(nxt, 0)
    assert alone == Generation(3, (1,)) and lead_of(alone) == 1
    assert survivors_after(alone, 1) is None  # no whole instance left: restart instead
    # (instances that stand alone, their state held elsewhere, one coming back: a generation of none)
    none = survivors_after(alone, 1, alone=True)
    assert none == Generation(4, ()) and Generation.from_bytes(none.to_bytes()) == none
    with pytest.raises(ConfigError, match="no pipeline instance trains in generation 4"):
        lead_of(none)
    assert Generation.from_bytes(alone.to_bytes()) == alone
    assert generation_key(3) == "pp/generation/3"
    for bad in (b"junk", b'{"number": 0, "instances": [1]}', b'{"number": 2, "instances": [1, 0]}'):
        with pytest.raises(ConfigError, match="generation"):
            Generation.from_bytes(bad)


def test_a_lost_instance_comes_back_in_the_next_generation() -> None:
    after_loss = Generation(2, (0, 2))
    back = joined(after_loss, 1)
    assert back == Generation(3, (0, 1, 2)) and lead_of(back) == 0
    with pytest.raises(ConfigError, match="already in generation 3"):
        joined(back, 2)
    assert (plan_key(3), ready_key(3, 4), joined_key(3, 4)) == ("pp/plan/3", "pp/ready/3/4", "pp/joined/3/4")


def test_the_progress_rows_name_each_stage_processes_instance_and_stage(tmp_path) -> None:
    import json

    from flotilla.config.cluster import WorkerSpec
    from flotilla.launch.pipeline_watch import snapshot

    workers = [WorkerSpec(name=n, speed=1.0, memory_bytes=2**20) for n in ("a0", "b0", "b1")]
    (tmp_path / "stage2.status.json").write_text(
        json.dumps({"step": 7, "loss": 2.5, "state": "training", "samples_per_s": 3.0})
    )
    rows = snapshot(tmp_path, workers, 0.0, Layout((1, 2)))["workers"]
    assert [r["name"] for r in rows] == ["a0 (0.0)", "b0 (1.0)", "b1 (1.1)"]
    assert [r["step"] for r in rows] == [0, 0, 7]
    assert [r["name"] for r in snapshot(tmp_path, workers, 0.0)["workers"]] == ["a0", "b0", "b1"]
