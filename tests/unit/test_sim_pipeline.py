"""Pipelines in virtual time (``sim/pipeline.py``): the runtime's split and schedules replayed, PP x
DP instances, revocations (an instance lost, the whole pipeline restarted from a checkpoint)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from flotilla.cli.main import app
from flotilla.cluster.comm_cost import ring_allreduce_s, transfer_s
from flotilla.cluster.spec import DeviceSpec, LinkModel, PairLink
from flotilla.pipeline.fixed_split import fixed_stage_plan
from flotilla.pipeline.plan import PartitionOptions
from flotilla.pipeline.profile import LayerProfile, ModelProfile
from flotilla.pipeline.schedule import ScheduleKind, make_schedule
from flotilla.pipeline.timeline import makespan_s, modelled_timeline
from flotilla.sim.model import Change, DeviceClass, Recovery, SimCluster, SimJob
from flotilla.sim.pipeline import PipelineSpec, pipeline_of, simulate_pipeline
from flotilla.sync.pipeline_settings import PipelineStrategy

ROOT = Path(__file__).resolve().parents[2]
BATCH = 32


def _profile(num_layers: int = 8) -> ModelProfile:
    """Uneven layers (a split has something to choose), a batch of ``BATCH``."""
    return ModelProfile(
        layers=tuple(
            LayerProfile(
                name=f"l{i}",
                forward_s=0.004 * (1 + i % 3),
                backward_s=0.008 * (1 + i % 3),
                activation_bytes=64_000,
                param_bytes=500_000 * (1 + i % 2),
            )
            for i in range(num_layers)
        ),  # fmt: skip
        batch_size=BATCH,
    )


def _job(steps: int = 50, **kw: object) -> SimJob:
    return SimJob(
        steps=steps, step_s=0.1, model_bytes=6_000_000, profile=_profile(), global_batch=BATCH, **kw
    )


def _cluster(*speeds: float) -> SimCluster:
    return SimCluster(
        classes=tuple(DeviceClass(type=f"d{i}", count=1, speed=s) for i, s in enumerate(speeds))
    )


def _expected_step(
    spec: PipelineSpec, cluster: SimCluster, share: float = BATCH, updates: tuple[float, ...] = ()
) -> float:
    """Written out with the runtime's pure pieces: its split on these devices, its schedule, the
    timeline replay -- what the simulator must reproduce, not a copy of it."""
    devices = cluster.devices()[: spec.num_stages]
    kind = ScheduleKind(spec.schedule)
    m = 1 if kind is ScheduleKind.PIPEDREAM else spec.num_microbatches
    links = LinkModel(
        pairs=tuple(
            PairLink(
                a=a.name,
                b=b.name,
                bandwidth_gbps=cluster.link_among([a, b]).bandwidth_gbps,
                latency_s=cluster.link_among([a, b]).latency_s,
            )
            for a, b in zip(devices, devices[1:])
        )  # fmt: skip
    )
    specs = [DeviceSpec(name=d.name, node=d.node, speed=d.speed, memory_bytes=2**40) for d in devices]
    plan = fixed_stage_plan(_profile(), specs, links, PartitionOptions(schedule=kind, num_microbatches=m))
    layers, scale = _profile().layers, share / BATCH / m
    fwd = [sum(x.forward_s for x in layers[s.layer_start : s.layer_end]) * scale / d.speed
           for s, d in zip(plan.stages, devices)]  # fmt: skip
    bwd = [sum(x.backward_s for x in layers[s.layer_start : s.layer_end]) * scale / d.speed
           for s, d in zip(plan.stages, devices)]  # fmt: skip
    comm = [transfer_s(layers[s.layer_end - 1].activation_bytes * scale, cluster.link_among([a, b]))
            for s, a, b in zip(plan.stages, devices, devices[1:])]  # fmt: skip
    opt = [sum(updates[s.layer_start : s.layer_end]) / d.speed if updates else 0.0
           for s, d in zip(plan.stages, devices)]  # fmt: skip
    if kind is not ScheduleKind.PIPEDREAM:
        return makespan_s(modelled_timeline(make_schedule(kind, len(devices), m), fwd, bwd, comm, opt))
    k = 2 * len(devices)
    a, b = (
        makespan_s(modelled_timeline(make_schedule(kind, len(devices), 1, n), fwd, bwd, comm, opt))
        for n in (k, 2 * k)
    )
    return (b - a) / k


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream"])
def test_a_step_is_the_runtime_split_and_schedule_replayed(schedule: str) -> None:
    spec = PipelineSpec(schedule=schedule, num_stages=3, num_microbatches=4)
    cluster = _cluster(1.0, 0.5, 0.8)  # (uneven devices: the split gives the fast one more)
    result = simulate_pipeline(_job(), cluster, spec)
    assert result.completed and result.steps == 50 and result.samples == 50 * BATCH
    assert result.time_s == pytest.approx(50 * _expected_step(spec, cluster), rel=1e-9)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream"])
def test_each_stage_pays_its_layers_optimizer_step_on_its_device(schedule: str) -> None:
    spec = PipelineSpec(schedule=schedule, num_stages=3, num_microbatches=4)
    cluster = _cluster(1.0, 0.5, 0.8)
    updates = tuple(0.002 * (1 + i % 2) for i in range(8))  # (the stage runtime stretches them too)
    result = simulate_pipeline(_job(optimizer_s=updates), cluster, spec)
    plain = simulate_pipeline(_job(), cluster, spec)
    assert result.time_s == pytest.approx(50 * _expected_step(spec, cluster, updates=updates), rel=1e-9)
    assert result.time_s > plain.time_s
    even = _cluster(0.5, 0.5, 0.5)  # (every stage's device time grows by its layers' updates / 0.5)
    with_updates = simulate_pipeline(_job(optimizer_s=updates), even, spec).parts
    without = simulate_pipeline(_job(), even, spec).parts
    grew = [with_updates[f"stage{i}.device_s"] - without[f"stage{i}.device_s"] for i in range(3)]
    assert all(g > 0 for g in grew) and sum(grew) == pytest.approx(sum(updates) / 0.5, rel=1e-9)
    with pytest.raises(ValueError, match=r"SimJob.optimizer_s: one time per profiled layer \(8\), got 2"):
        _job(optimizer_s=(0.1, 0.1))


def test_a_wrong_schedule_or_split_changes_the_prediction() -> None:
    """Mutations: the same job under another schedule, or on devices in another order (another
    split), takes another time -- the prediction comes from the schedule and the split."""
    base = simulate_pipeline(_job(), _cluster(1.0, 0.5, 0.8), PipelineSpec(num_stages=3, num_microbatches=4))
    other_schedule = simulate_pipeline(
        _job(), _cluster(1.0, 0.5, 0.8), PipelineSpec(schedule="gpipe", num_stages=3, num_microbatches=2)
    )
    reordered = simulate_pipeline(
        _job(), _cluster(0.5, 1.0, 0.8), PipelineSpec(num_stages=3, num_microbatches=4)
    )
    assert len({base.time_s, other_schedule.time_s, reordered.time_s}) == 3


def test_more_devices_run_instances_that_reduce_each_stage_together() -> None:
    spec = PipelineSpec(num_stages=2, num_microbatches=4)
    cluster = SimCluster(classes=(DeviceClass(type="gpu", count=5),))  # 2 instances and a spare
    result = simulate_pipeline(_job(), cluster, spec)
    layers = _profile().layers
    one = fixed_stage_plan(
        _profile(),
        [DeviceSpec(name=d.name, node=d.node, memory_bytes=2**40) for d in cluster.devices()[:2]],
        LinkModel(),
        PartitionOptions(schedule=ScheduleKind.ONE_F_ONE_B, num_microbatches=4),
    )
    stage_bytes = [sum(x.param_bytes for x in layers[s.layer_start : s.layer_end]) for s in one.stages]
    reduce = max(ring_allreduce_s(2, b, cluster.inter_node) for b in stage_bytes)
    assert result.time_s == pytest.approx(50 * (_expected_step(spec, cluster, BATCH / 2) + reduce), rel=1e-9)
    assert "2 instance(s)" in result.note
    alone = simulate_pipeline(_job(), SimCluster(classes=(DeviceClass(type="gpu", count=2),)), spec)
    assert result.time_s < alone.time_s  # (half the batch each, at the price of the all-reduce)
    assert result.device_s == pytest.approx(5 * result.time_s)  # (the spare is held and paid for)


def test_instances_are_as_many_as_the_batch_fills_with_microbatches() -> None:
    """The runtime refuses an instance whose share of a batch cannot fill its microbatches: 32
    samples in microbatches of 8 make at most 4 instances; the other devices are spares."""
    cluster = SimCluster(classes=(DeviceClass(type="gpu", count=20),))
    result = simulate_pipeline(_job(), cluster, PipelineSpec(num_stages=2, num_microbatches=8))
    assert "4 instance(s)" in result.note
    assert result.device_s == pytest.approx(20 * result.time_s)  # (the spares are paid for)


def test_a_lost_instance_leaves_the_others_training_and_comes_back() -> None:
    cluster = SimCluster(classes=(DeviceClass(type="gpu", count=4),))
    changes = [Change(at_s=0.5, kill=True, name="gpu-3"), Change(at_s=1.0, kill=False, name="gpu-3")]
    rec = Recovery(detect_s=0.2, repair_s=0.05, startup_s=1.0)
    spec = PipelineSpec(num_stages=2, num_microbatches=4)
    result = simulate_pipeline(_job(steps=200), cluster, spec, changes=changes, recovery=rec)
    calm = simulate_pipeline(_job(steps=200), cluster, spec)
    assert result.completed and len(result.recoveries_s) == 1
    assert 0.2 < result.recoveries_s[0] < 1.0  # detected and re-formed, not waiting for the arrival
    assert result.samples == calm.samples  # no step redone from a checkpoint: nothing restarted
    assert calm.time_s < result.time_s < calm.time_s + 3.0
    assert "2 instance(s)" in result.note  # (the arrival made the second instance again)


def test_a_broken_instances_survivors_and_a_spare_form_an_instance_again() -> None:
    """5 devices, 2 stages: gpu-0 revoked, nobody arrives; gpu-1 (its stage process restarted,
    ``startup_s``) and the spare gpu-4 form the second instance again."""
    cluster = SimCluster(classes=(DeviceClass(type="gpu", count=5),))
    rec = Recovery(detect_s=0.2, repair_s=0.05, startup_s=1.0)
    spec = PipelineSpec(num_stages=2, num_microbatches=4)
    result = simulate_pipeline(
        _job(steps=300), cluster, spec, changes=[Change(at_s=0.5, kill=True, name="gpu-0")], recovery=rec
    )
    assert result.completed and "2 instance(s)" in result.note
    during = [n for t, _, n in result.timeline if 0.5 < t]
    assert during and all(n == 4 for n in during)  # (the live devices, as the other strategies count)
    no_spare = simulate_pipeline(  # (4 devices: gpu-1 alone cannot make an instance)
        _job(steps=300), SimCluster(classes=(DeviceClass(type="gpu", count=4),)), spec,
        changes=[Change(at_s=0.5, kill=True, name="gpu-0")], recovery=rec,
    )  # fmt: skip
    assert "1 instance(s)" in no_spare.note and result.time_s < 0.8 * no_spare.time_s


def test_losing_the_only_instance_restarts_from_the_newest_checkpoint() -> None:
    cluster = SimCluster(classes=(DeviceClass(type="gpu", count=2),))
    job = _job(steps=100, checkpoint_every_steps=10, checkpoint_s=0.01)
    spec = PipelineSpec(num_stages=2, num_microbatches=4)
    step = simulate_pipeline(job, cluster, spec).time_s / 100
    kill_at = 25.5 * step  # (during step 26: steps 21-25 since the checkpoint at 20 are redone)
    changes = [
        Change(at_s=kill_at, kill=True, name="gpu-1"),
        Change(at_s=kill_at + 1, kill=False, name="gpu-1"),
    ]
    rec = Recovery(detect_s=0.2, repair_s=0.05, startup_s=2.0)
    result = simulate_pipeline(job, cluster, spec, changes=changes, recovery=rec)
    assert result.completed and result.steps == 100
    assert result.samples == (100 + 5) * BATCH, "the steps after the newest checkpoint are redone"
    assert "restarted from a checkpoint" in result.note
    assert result.recoveries_s and result.recoveries_s[0] >= 3.0  # (the replacement's arrival + start-up)


def test_too_few_devices_left_ends_the_run_with_a_note() -> None:
    cluster = SimCluster(classes=(DeviceClass(type="gpu", count=2),))
    result = simulate_pipeline(
        _job(), cluster, PipelineSpec(), changes=[Change(at_s=0.3, kill=True, name="gpu-0")]
    )
    assert not result.completed and result.steps < 50
    assert "fewer than 2 devices left" in result.note


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: simulate_pipeline(SimJob(steps=5, step_s=0.1, model_bytes=1), _cluster(1, 1)),
            "SimJob.profile",
        ),
        (lambda: simulate_pipeline(_job(), _cluster(1.0), PipelineSpec(num_stages=2)), "needs at least 2"),
        (lambda: simulate_pipeline(_job(), _cluster(*[1.0] * 9), PipelineSpec(num_stages=9)), "8 layers"),
        (lambda: PipelineSpec(schedule="zigzag"), "PipelineSpec.schedule"),
        (lambda: PipelineSpec(num_microbatches=0), "PipelineSpec.num_microbatches"),
        (lambda: SimJob(steps=5, step_s=0.1, model_bytes=1, global_batch=-1), "SimJob.global_batch"),
    ],
)
def test_bad_input_names_the_field(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]


def test_the_strategy_spec_names_it_and_flotilla_simulate_runs_it(tmp_path: Path) -> None:
    spec = pipeline_of(PipelineStrategy(schedule="gpipe", num_stages=2, num_microbatches=4))
    assert spec == PipelineSpec(schedule="gpipe", num_stages=2, num_microbatches=4)
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            str(ROOT / "examples" / "pipeline_lm.yaml"),
            "--step-s",
            "0.02",
            "--set",
            "job.steps=20",
        ],
    )
    assert result.exit_code == 0, result.output
    assert (
        "pipeline " in result.output
        and "done" in result.output
        and "1 instance(s) of 2 stages" in result.output
    )
