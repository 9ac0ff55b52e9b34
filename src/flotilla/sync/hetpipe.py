"""Strategy ``hetpipe``: HetPipe's virtual workers (Park et al., USENIX ATC'20; SPEC §2;
``docs/hetpipe.md``).  A virtual worker (VW) is a pipeline instance of ``num_stages`` stage
processes running PipeDream's asynchronous schedule with ``s_local + 1`` minibatches in flight;
the ``replicas`` VWs do data parallelism with each other through parameter-server shards the
launcher hosts, under Wave Synchronous Parallel (``clock_distance`` D): each stage pushes the
sum of its updates once per wave of ``s_local + 1`` minibatches and folds the global weights in
(``sync/hetpipe_stage.py``; the rules: ``sync/hetpipe_plan.py``); every stage checks SPEC §2's
bound on what each of its forwards ran with and fails the run on a violation.

Placement (``placement``): ``np``, ``ed``, ``hd`` or ``auto`` (the fastest predicted of them)
forms the VWs from the cluster's devices by their ``type`` and ``node`` and cuts each VW's
pipeline over its own devices (``pipeline/vw_placement.py``, no replicated stages: a stage runs on
one device); the launcher starts a stage process per used device, VW by VW
(``launch/pipeline_prepare.py``), and devices a placement leaves out are not started.  ``given``:
VW k is ``cluster.workers[k * num_stages : (k + 1) * num_stages]`` (stage i on the i-th of them),
one split for every VW planned over the weakest device of each position; ``num_stages`` and
``replicas`` are set with ``given`` only (a placement decides them).  Each VW takes an equal
share of every batch: its part in the servers' data view of the step's wave.  A VW whose stage
dies is evicted from the servers (its unfinished wave discarded on every shard) and the others
train on, taking its share from the next data view on (its slices in between are listed as
dropped).  Then, while ``job.max_restarts`` allows, it comes back on the same devices with the
same cut: new stage processes join the servers as a new worker (``HetPipePlug.start_step``: the
clock the servers give it, at least their global clock; its data share from the data view it
joins), start from the global weights of that clock and train on from its first minibatch.
With ``reform: true`` (``flotilla run`` only) a VW lost because one of its stages died is formed
again **without that device** -- its device counted gone for the rest of the run, as a revoked
spot machine: from its surviving devices and the devices no VW uses, with as few added as hold
the model and speed the job up (``pipeline/vw_reform.py``, the placement's partitioner and cost
model), cut anew, on new stage processes (``launch/pipeline_reform.py``); until such a group
exists it waits (tried again whenever a VW is lost or comes back).

This module is the whole strategy: its settings and spec here, the stages' side in
``sync/hetpipe_stage.py``, the launcher's in ``sync/hetpipe_host.py``, reached through the spec's
``stages`` hook (``sync/stage_plug.py``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import Field

from flotilla.cluster.launch_plan import LaunchNeeds, Runner
from flotilla.sync.pipeline_settings import PipelineStrategy, check_workers
from flotilla.sync.spec import RunFacts, StrategySpec, settings_error
from flotilla.sync.stage_plug import (
    HostContext,
    HostSide,
    PlaceContext,
    Placed,
    PlannedInstance,
    StageContext,
    StageSide,
    StartContext,
)

__all__ = ["SPEC", "HetPipePlug", "HetPipeStrategy", "plug_of"]


class HetPipeStrategy(PipelineStrategy):
    """HetPipe's virtual workers (module doc).  ``replicas``: the number of VWs."""

    kind: Literal["hetpipe"] = "hetpipe"  # type: ignore[assignment]
    schedule: Literal["pipedream"] = "pipedream"
    num_microbatches: int = Field(default=1, ge=1, le=1)
    vertical_sync: Literal[False] = False
    # which devices form each VW, each cut over its own (module doc); given: num_stages, replicas
    placement: Literal["auto", "np", "ed", "hd", "given"] = "auto"
    num_stages: int | None = Field(default=None, ge=1, le=64)  # type: ignore[assignment]
    replicas: int | None = Field(default=None, ge=1, le=64)  # type: ignore[assignment]
    s_local: int = Field(default=1, ge=0, le=64)  # a wave: s_local + 1 minibatches
    clock_distance: int = Field(default=0, ge=0, le=1000)  # D
    ps_shards: int = Field(default=1, ge=1, le=16)
    # a VW lost because a stage died is formed again without that device (module doc); false:
    # it comes back on its own devices
    reform: bool = False
    # how long a stage's wave sync (push, vote, the pull held at the WSP gate) may take in all
    pull_timeout_s: float = Field(default=300.0, gt=0, le=86400)

    def in_flight(self) -> int | None:
        return self.s_local + 1

    def launch_needs(self, declared: LaunchNeeds) -> LaunchNeeds:
        """With ``reform``, a revocation schedule: a revoked device's VW is formed again without
        it, a device added is free for the next (module doc)."""
        return replace(declared, revocations=True) if self.reform else declared

    @property
    def num_processes(self) -> int:
        """Stage processes: ``num_stages x replicas`` with ``given``; 0 (not known before the
        placement: at most one per worker) otherwise."""
        if self.num_stages is None or self.replicas is None:
            return 0
        return self.num_stages * self.replicas


def _check(settings: Any, facts: RunFacts) -> None:
    given = settings.placement == "given"
    for name in ("num_stages", "replicas"):
        if given and getattr(settings, name) is None:
            raise settings_error(
                name,
                "must be set with placement: given (stage i of VW k on cluster.workers[k * num_stages + i])",
            )
        if not given and getattr(settings, name) is not None:
            raise settings_error(
                name,
                f"is decided by placement {settings.placement!r} (it forms the VWs and cuts each one); "
                "set num_stages and replicas only with placement: given",
            )
    if not given:
        return
    check_workers(settings, facts, "virtual worker")
    if facts.batch_size < settings.replicas:
        raise settings_error(
            "replicas",
            f"must be <= job.batch_size ({facts.batch_size}): each VW takes a share of every batch",
        )


class HetPipePlug:
    """The ``stages`` hook (``sync/stage_plug.py``) of ``hetpipe``."""

    independent_instances = True
    instances_return = True  # (a lost VW comes back as a new worker of the servers: start_step)
    keeps_checkpoints = True  # (the servers' snapshots: sync/hetpipe_host.py)
    sized_messages = True  # (a data view after an eviction re-splits batches already prefetched)

    def __init__(self, settings: HetPipeStrategy) -> None:
        self.settings = settings
        self.reforms = bool(settings.reform)
        self._joined: Any = None  # (a newcomer's client, said hello in start_step, for attach)

    def start_step(self, ctx: StartContext) -> int | None:
        """A VW coming back, or any VW of a resumed job: where the servers let it start (its
        client said hello, kept for ``attach``); a fresh start: None (step 0)."""
        if not ctx.join and not ctx.services.get("resume_at"):
            return None
        from flotilla.sync.hetpipe_stage import join_wave

        self._joined, wave = join_wave(self.settings, ctx)
        return int(wave * (self.settings.s_local + 1))

    def attach(self, ctx: StageContext) -> StageSide:
        from flotilla.sync.hetpipe_stage import HetPipeStage

        joined, self._joined = self._joined, None
        return HetPipeStage(self.settings, ctx, joined)

    def place(self, ctx: PlaceContext) -> Placed | None:
        if self.settings.placement == "given":
            return None
        from flotilla.sync.hetpipe_place import place_vws

        return place_vws(self.settings, ctx)

    def reform(
        self,
        ctx: PlaceContext,
        survivors: tuple[str, ...],
        free: tuple[str, ...],
        others: tuple[tuple[str, ...], ...],
    ) -> PlannedInstance | str | None:
        if not self.settings.reform:
            return None
        from flotilla.sync.hetpipe_place import reform_vw

        return reform_vw(self.settings, ctx, survivors, free, others)

    def host(self, ctx: HostContext) -> HostSide:
        from flotilla.sync.hetpipe_host import HetPipeHost

        return HetPipeHost(self.settings, ctx)


def plug_of(settings: HetPipeStrategy) -> HetPipePlug:
    return HetPipePlug(settings)


SPEC = StrategySpec(
    kind="hetpipe",
    settings=HetPipeStrategy,
    summary="HetPipe: pipelines as virtual workers, WSP through parameter servers (SPEC §2)",
    check=_check,
    # (stages on CUDA: not tried yet -- the waves' sums travel through host memory untested)
    launch=LaunchNeeds(runner=Runner.PIPELINE, revocations=False, gpu=False),
    stages="flotilla.sync.hetpipe:plug_of",
    simulated="flotilla.sim.hetpipe:hetpipe_of",
)
