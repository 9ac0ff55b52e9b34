"""The pure launch plan: which processes a job needs and what its strategy allows."""

from __future__ import annotations

import pytest

from flotilla.cluster.launch_plan import LaunchInput, LaunchNeeds, Runner, launch_plan
from flotilla.config import load_config
from flotilla.sync import registry


def _input(kind: str, **kw: object) -> LaunchInput:
    return LaunchInput(kind=kind, needs=registry.spec_of(kind).launch, **kw)  # type: ignore[arg-type]


WORKERS = ("w0", "w1", "w2")


def test_data_parallel_kinds() -> None:
    ar = launch_plan(_input("allreduce", workers=WORKERS, resume=True, checkpoint=True))
    assert ar.runner is Runner.COORDINATED and ar.workers == WORKERS and ar.num_servers == 0
    assert ar.gpu and not ar.clock_spread and not ar.refusal and ar.local_compute_procs == 3
    ps = launch_plan(_input("ps", workers=WORKERS, num_servers=2))
    assert ps.num_servers == 2 and ps.clock_spread and ps.gpu and ps.local_compute_procs == 5
    custom = launch_plan(LaunchInput(kind="toy_pairs", workers=WORKERS))  # any registered kind
    assert custom.runner is Runner.COORDINATED and not custom.gpu


@pytest.mark.parametrize(
    ("resume", "checkpoint", "words"),
    [(True, False, ""), (False, True, "checkpoint: strategy ps"), (True, True, "checkpoint: strategy ps")],
)
def test_ps_resumes_from_its_snapshots_and_refuses_job_checkpoints(
    resume: bool, checkpoint: bool, words: str
) -> None:
    plan = launch_plan(_input("ps", workers=WORKERS, num_servers=1, resume=resume, checkpoint=checkpoint))
    assert plan.refusal.startswith(words) and bool(plan.refusal) == bool(words)


def test_a_strategy_with_its_state_elsewhere_that_cannot_resume_refuses_resume() -> None:
    needs = LaunchNeeds(durable_state="its workers' own replicas")
    plan = launch_plan(LaunchInput(kind="toy", needs=needs, workers=WORKERS, resume=True))
    assert plan.refusal.startswith("--resume is not supported for strategy toy")


def test_pipeline_runs_one_stage_per_stage_on_the_first_workers() -> None:
    plan = launch_plan(_input("pipeline", workers=WORKERS, num_stages=2))
    assert plan.runner is Runner.PIPELINE and plan.workers == ("w0", "w1") and plan.local_compute_procs == 2


def test_the_config_builds_its_plan() -> None:
    cfg = load_config("examples/ps_ssp.yaml")
    plan = cfg.launch_plan()
    assert plan.num_servers == cfg.strategy.num_servers and plan.clock_spread  # type: ignore[union-attr]
    assert load_config("examples/pipeline_lm.yaml").launch_plan().runner is Runner.PIPELINE


@pytest.mark.parametrize(("kind", "words"), [("pipeline", "stage")])
def test_revocation_schedules_are_refused_where_a_revoked_worker_ends_the_job(kind: str, words: str) -> None:
    plan = launch_plan(_input(kind, workers=WORKERS, num_servers=1, revocations=True))
    assert plan.refusal.startswith(f"cluster.revocations: strategy {kind}") and words in plan.refusal
    assert not launch_plan(_input("allreduce", workers=WORKERS, revocations=True)).refusal
    # a revoked PS worker is evicted from the shards' clocks and the others go on (docs/ps.md)
    assert not launch_plan(_input("ps", workers=WORKERS, num_servers=1, revocations=True)).refusal


def test_the_refusal_names_only_strategies_that_take_a_schedule() -> None:
    """(It said "revocation schedules run under allreduce and ps" while partial_reduce, adpsgd and
    diloco took them too, and "a dead stage ends the job" of HetPipe, whose dead VW is evicted.)"""
    plan = launch_plan(_input("hetpipe", workers=WORKERS, num_stages=2, revocations=True))
    named = plan.refusal.split("(e.g. ")[1].rstrip(")").split(", ")
    assert len(named) >= 5 and "ends the job" not in plan.refusal
    for kind in named:
        assert registry.spec_of(kind).launch.revocations, kind
