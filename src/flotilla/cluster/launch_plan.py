"""The launch plan (pure): which processes a job needs and what its strategy allows, from the
run configuration's few facts.  The one place besides the strategy registry where a strategy
*kind* is matched: the launcher, the coordinator and the builders ask the plan instead of
comparing ``strategy.kind`` themselves.

- ``allreduce`` (and any registered data-parallel kind): a coordinator, one worker per cluster
  worker; checkpoints and ``--resume``; GPUs (NCCL);
- ``ps``: the same plus one server per shard; no job checkpoints (the servers snapshot their own
  state), no ``--resume``; the report tracks the spread of the workers' clocks;
- ``pipeline``: one stage process per stage on the cluster's first workers, no coordinator;
  checkpoints at flush boundaries and ``--resume``.

No torch, no I/O: the launcher builds a :class:`LaunchInput` from the validated configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["LaunchInput", "LaunchPlan", "Runner", "launch_plan"]


class Runner(Enum):
    COORDINATED = "coordinated"  # coordinator + workers (+ PS servers)
    PIPELINE = "pipeline"  # stage processes over one static group


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchInput:
    kind: str  # strategy.kind
    workers: tuple[str, ...]  # the cluster's worker names, in order
    num_servers: int = 0  # strategy ps: shards
    num_stages: int = 0  # strategy pipeline: stages
    resume: bool = False  # --resume given
    checkpoint: bool = False  # a checkpoint section
    revocations: bool = False  # a revocation schedule (cluster.revocations)


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchPlan:
    runner: Runner
    workers: tuple[str, ...]  # worker processes (coordinated) or stage processes (pipeline)
    num_servers: int
    clock_spread: bool  # the report tracks the spread of the workers' clocks (ps)
    gpu: bool  # GPU workers are supported
    refusal: str = ""  # why this job cannot run as configured ("" = it can)

    @property
    def local_compute_procs(self) -> int:
        """Processes that compute on this machine (their intra-op threads share the cores)."""
        return len(self.workers) + self.num_servers


_PS_RESUME = (
    "--resume is not supported for strategy ps (its servers keep their durable state in their own "
    "snapshots, docs/ps.md); it is supported for allreduce and pipeline"
)
_PS_CHECKPOINT = (
    "checkpoint: strategy ps keeps its durable state in the servers' snapshots (docs/ps.md); "
    "job checkpoints are supported for allreduce and pipeline"
)


def _revocations_refused(kind: str) -> str:
    return (
        f"cluster.revocations: strategy {kind} does not survive a revoked worker yet (a dead "
        f"{'stage' if kind == 'pipeline' else 'PS worker'} ends the job); revocation schedules "
        "run under allreduce and ps"
    )


def launch_plan(j: LaunchInput) -> LaunchPlan:
    """The processes of the job described by ``j`` (see the module doc)."""
    if j.kind == "pipeline":
        stages = j.workers[: j.num_stages] if j.num_stages else j.workers
        return LaunchPlan(
            runner=Runner.PIPELINE,
            workers=stages,
            num_servers=0,
            clock_spread=False,
            gpu=False,
            refusal=_revocations_refused(j.kind) if j.revocations else "",
        )
    if j.kind == "ps":
        refusal = _PS_RESUME if j.resume else _PS_CHECKPOINT if j.checkpoint else ""
        # (a revoked PS worker is evicted from the shards' clocks: docs/ps.md, "Membership")
        return LaunchPlan(
            runner=Runner.COORDINATED,
            workers=j.workers,
            num_servers=j.num_servers,
            clock_spread=True,
            gpu=False,
            refusal=refusal,
        )
    gpu = j.kind == "allreduce"
    return LaunchPlan(
        runner=Runner.COORDINATED, workers=j.workers, num_servers=0, clock_spread=False, gpu=gpu
    )
