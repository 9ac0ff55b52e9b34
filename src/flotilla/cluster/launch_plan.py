"""The launch plan (pure): which processes a job needs and what its strategy allows, from the
run configuration's few facts and the strategy's declared :class:`LaunchNeeds` (its registered
spec, ``sync/spec.py``).  No strategy kind is compared here: a new strategy declares its needs.

- the default (``allreduce``, ``partial_reduce``, ``diloco``, a user's strategy): a coordinator,
  one worker per cluster worker; checkpoints and ``--resume``; GPUs where the spec says so;
- ``servers`` (``ps``): one server process per shard too; a strategy whose durable state lives
  elsewhere (``durable_state``: the servers' snapshots) refuses job checkpoints, and
  ``--resume`` unless it resumes from that state (``resumes``: ps, ``launch/ps_resume.py``);
  the report tracks the spread of the workers' clocks (``clock_spread``);
- ``Runner.PIPELINE``: one stage process per stage on the cluster's first workers, no
  coordinator; checkpoints at flush boundaries and ``--resume``;
- ``revocations``: whether a revoked worker is survived (a schedule is refused otherwise).

No torch, no I/O: the launcher builds a :class:`LaunchInput` from the validated configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["LaunchInput", "LaunchNeeds", "LaunchPlan", "Runner", "launch_plan"]


class Runner(Enum):
    COORDINATED = "coordinated"  # coordinator + workers (+ PS servers)
    PIPELINE = "pipeline"  # stage processes over one static group


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchNeeds:
    """What a strategy needs from the launcher (declared by its spec)."""

    runner: Runner = Runner.COORDINATED
    servers: bool = False  # parameter-server shards (``strategy.num_servers`` of them)
    gpu: bool = False  # its workers may compute on CUDA
    durable_state: str = ""  # where its durable state lives if not in job checkpoints ("": in them)
    resumes: bool = False  # with durable_state: --resume restores that state (ps: its snapshots)
    clock_spread: bool = False  # the report tracks the spread of the workers' clocks
    revocations: bool = True  # it survives a revoked worker
    # ``flotilla run`` adds default time-based checkpoints when the config has none (rank 0
    # writes the job's state: allreduce's replica, DiLoCo's outer state, AD-PSGD's average)
    auto_checkpoint: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchInput:
    kind: str  # strategy.kind (named in refusals)
    needs: LaunchNeeds = LaunchNeeds()
    workers: tuple[str, ...]  # the cluster's worker names, in order
    num_servers: int = 0  # strategy ps: shards
    num_stages: int = 0  # strategy pipeline: stage processes (stages x replicas)
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


def _state_refusal(kind: str, where: str, resume: bool) -> str:
    if resume:
        return (
            f"--resume is not supported for strategy {kind} (it keeps its durable state in {where}); "
            "it is supported for strategies whose workers hold the state (e.g. allreduce, pipeline) "
            "and for ps (from its servers' snapshots)"
        )
    return (
        f"checkpoint: strategy {kind} keeps its durable state in {where}; job checkpoints "
        "are supported for strategies whose workers hold the state (e.g. allreduce, pipeline)"
    )


def _revocations_refused(kind: str, pipeline: bool) -> str:
    if pipeline:  # (a stage that dies is restarted, or its instance dropped: nothing revokes one)
        why = (
            "its stages run under the pipeline runner, which takes one only where a lost instance "
            "is formed again on other devices: e.g. hetpipe with reform: true"
        )
    else:
        why = "it does not survive a revoked worker yet"
    return (
        f"cluster.revocations: strategy {kind} takes no revocation schedule ({why}); schedules run "
        "under the data-parallel strategies, whose workers a coordinator keeps (e.g. allreduce, ps, "
        "partial_reduce, adpsgd, diloco)"
    )


def launch_plan(j: LaunchInput) -> LaunchPlan:
    """The processes of the job described by ``j`` (see the module doc)."""
    n = j.needs
    pipeline = n.runner is Runner.PIPELINE
    refusal = ""
    if n.durable_state and (j.checkpoint or (j.resume and not n.resumes)):
        refusal = _state_refusal(j.kind, n.durable_state, j.resume and not n.resumes)
    elif j.revocations and not n.revocations:
        refusal = _revocations_refused(j.kind, pipeline)
    stages = j.workers[: j.num_stages] if j.num_stages else j.workers
    return LaunchPlan(
        runner=n.runner,
        workers=stages if pipeline else j.workers,
        num_servers=j.num_servers if n.servers else 0,
        clock_spread=n.clock_spread,
        gpu=n.gpu,
        refusal=refusal,
    )
