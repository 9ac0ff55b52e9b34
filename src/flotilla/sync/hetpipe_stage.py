"""One HetPipe stage's side of Wave Synchronous Parallel (SPEC §2; the rules:
``sync/hetpipe_plan.py``): attached to a stage's :class:`~flotilla.pipeline.runtime.StageRuntime`
running PipeDream's schedule with ``s_local + 1`` minibatches in flight, it pushes the stage's
part of the virtual worker's update once per wave and folds the pulled global weights in, through
a :class:`~flotilla.ps.client_parts.VWPartClient` on one background thread (so the pipeline goes
on while the parameter server's gate holds the pull).

Weights: the live weights ``w`` are always ``anchor + L``, ``L`` the stage's local updates not
yet pushed.  At a wave's end the stage pushes ``L = w - anchor`` (a copy) and sets
``anchor = w``; when the pull of that wave's next clock brings the global weights ``G`` (all of
this VW's waves up to that one, and at least ``c_global`` waves of every VW), the stage sets
``w = G + L`` and ``anchor = G`` -- right after an update, before any pass used the newest
version (``StageRuntime.amend_newest``), so weight stashing stays exact.  The server adds the
pushed sums (``update: delta``).

Invariants: syncs run in wave order on one thread; a pull is folded in only if no later wave was
pushed since it was issued (else it is dropped: its global state lacks that wave); every forward
is recorded (:meth:`WaveSync.records`) with what its weights hold; a sync's error is raised on
the training thread at the next forward that needs it, or by :meth:`WaveSync.finish`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from flotilla.core.errors import FlotillaError
from flotilla.core.log import get_logger
from flotilla.pipeline.runtime import StageRuntime
from flotilla.ps.client import keys_of
from flotilla.ps.client_parts import VWPartClient
from flotilla.ps.config import ClientOptions
from flotilla.ps.consistency import WSP, s_global
from flotilla.ps.data_views import split_of
from flotilla.ps.wsp import MinibatchRecord, check_sglobal_bound, check_slocal_bound, max_observed_staleness
from flotilla.sync.hetpipe_plan import WavePlan, WaveView
from flotilla.sync.stage_plug import StageContext, StartContext

__all__ = ["HetPipeStage", "PulledWave", "WaveSync", "join_wave", "part_client", "worker_id_of"]

log = get_logger("hetpipe")


@dataclass(frozen=True, slots=True)
class PulledWave:
    """The answer of one wave's vote and pull: the global weights of the stage's keys."""

    clock: int  # the pull's clock (this VW's waves 0 … clock-1 are in ``weights``)
    weights: dict[str, torch.Tensor]
    c_global: int


class WaveSync:
    """The WSP side of one stage (module doc).  ``keys``: this stage's parameter names (in
    ``runtime.module``) -> their PS key names (the whole model's)."""

    def __init__(
        self,
        runtime: StageRuntime,
        client: VWPartClient,
        plan: WavePlan,
        *,
        vw: int,
        num_vws: int,
        keys: Mapping[str, str],
    ) -> None:
        self.runtime, self.client, self.plan = runtime, client, plan
        params = dict(runtime.module.named_parameters())
        if set(keys) != set(params):
            raise FlotillaError(f"keys must name every parameter of the stage, got {sorted(keys)[:4]}")
        self._params = {keys[name]: p for name, p in params.items()}
        with torch.no_grad():
            self._anchor = {k: p.detach().clone() for k, p in self._params.items()}
        # (a VW coming back: its earlier waves count as done; its weights come with start_from)
        self.view = WaveView(vw=vw, num_vws=num_vws, local_done=plan.first_minibatch)
        self._records: list[MinibatchRecord] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"flotilla-wsp-vw{vw}")
        self._pending: tuple[int, Future[PulledWave]] | None = None  # (wave pushed, its pull)
        self._last_push: Future[PulledWave] | None = None
        self.waited_s = 0.0  # time the stage waited at the gate (outside its compute)
        self.waits = 0
        self._t0 = time.perf_counter()
        runtime.after_update = self._after_update
        runtime.before_forward = self._before_forward

    @property
    def records(self) -> tuple[MinibatchRecord, ...]:
        return tuple(self._records)

    # ------------------------------------------------------------------ runtime hooks
    def _after_update(self, v: int, module: torch.nn.Module) -> None:
        self.view = replace(self.view, local_done=self.view.local_done + 1)
        u = self.plan.ends_wave(v)
        if u is None:
            return
        with torch.no_grad():
            delta = {k: p.detach() - self._anchor[k] for k, p in self._params.items()}
            for k, p in self._params.items():
                self._anchor[k].copy_(p.detach())
        self._pending = (u, self._pool.submit(self._sync, u, delta))  # (an older pull is dropped)
        self._last_push = self._pending[1]

    def _before_forward(self, b: int) -> None:
        need = self.plan.needed_clock(b)
        if self._pending is not None:
            u, fut = self._pending
            if need > u + 1:
                raise FlotillaError(
                    f"minibatch {b} needs the pull of clock {need}; wave {need - 1} was never pushed"
                )
            if fut.done() or need == u + 1:
                if not fut.done():
                    began = time.perf_counter()
                    fut.result()
                    self.waited_s += time.perf_counter() - began
                    self.waits += 1
                self._fold(fut.result())
                self._pending = None
        if need > self.view.pulled:
            raise FlotillaError(
                f"minibatch {b} needs the pull of clock {need}, the weights hold {self.view.pulled}"
            )
        tick = int((time.perf_counter() - self._t0) * 1e6)
        self._records.append(self.view.record(self.plan.first_minibatch + b, self.plan.wave_size, tick))

    # ------------------------------------------------------------------ the background thread
    def _sync(self, u: int, delta: dict[str, torch.Tensor]) -> PulledWave:
        """Stage the part of wave ``u``, vote to commit it and pull clock ``u + 1``."""
        self.client.stage(delta, u)
        out = {k: torch.empty_like(t) for k, t in delta.items()}
        self.client.vote_pull(delta, u, out)
        return PulledWave(clock=u + 1, weights=out, c_global=min(self.client.read_c_global))

    def start_from(self, pulled: PulledWave) -> None:
        """A VW coming back: its weights become the global state ``pulled`` (of its first wave's
        clock) before its first forward."""
        if pulled.clock != self.plan.first_wave or self._records:
            raise FlotillaError(
                f"start_from: the global state of clock {pulled.clock}, before the first forward of "
                f"wave {self.plan.first_wave}"
            )
        self._fold(pulled, running=False)

    def _fold(self, pulled: PulledWave, *, running: bool = True) -> None:
        def change() -> None:
            for k, p in self._params.items():
                g = pulled.weights[k]
                p.add_(g - self._anchor[k])  # w = G + (w - anchor)
                self._anchor[k].copy_(g)

        if running:
            self.runtime.amend_newest(change)
        else:  # (before the runtime's first run: its version 0 is whatever the weights are then)
            with torch.no_grad():
                change()
        self.view = replace(self.view, pulled=pulled.clock, c_global=pulled.c_global)

    # ------------------------------------------------------------------ end
    def finish(self) -> PulledWave | None:
        """Wait for the last wave's push (and its pull: returned, not folded in); raise its error."""
        try:
            return self._last_push.result() if self._last_push is not None else None
        finally:
            self._pool.shutdown(wait=True)


def worker_id_of(instance: int, arrival: int, num_instances: int) -> int:
    """A VW's worker id on the servers: its instance index, or, for the newcomers of round
    ``arrival`` bringing it back, ``instance + num_instances * arrival`` (``arrival``: the
    launcher's serial, never reused -- not even by a round tried again after its newcomers were
    given up --, so a departed id never comes back; ``id % num_instances`` is the instance:
    ``HetPipeHost.lost`` evicts by it)."""
    if arrival < 0:
        raise ValueError(f"worker_id_of: arrival must be >= 0, got {arrival}")
    return instance if arrival == 0 else instance + num_instances * arrival


def part_client(settings: Any, ctx: StageContext | StartContext, worker_id: int) -> VWPartClient:
    """The stage's client of the VW ``worker_id`` on the launcher's servers (not said hello yet)."""
    return VWPartClient(
        [str(a) for a in ctx.services["ps"]],
        ctx.secret,
        worker_id=worker_id,
        keys=keys_of(ctx.all_keys),
        own=set(ctx.model_keys.values()),
        part=ctx.stage,
        parts=ctx.num_stages,
        options=ClientOptions(pull_timeout_s=float(settings.pull_timeout_s)),
    )


def join_wave(settings: Any, ctx: StartContext) -> tuple[VWPartClient, int]:
    """A stage of a VW coming back, or of any VW of a resumed job (``HetPipePlug.start_step``):
    its client, said hello as the VW's worker id -- a new one for a VW coming back -- and the
    clock the servers gave it on every shard: the VW's first wave (coming back: at least their
    global clock and the start of the data view it joins; resumed: the clock the job resumes
    at; ``ps/clock_rules.py``).  Every stage of the VW gets the same clock (the first hello on a
    shard fixes it there; a hello naming a higher one moves it up, and each stage takes the
    highest)."""
    wid = worker_id_of(ctx.instance, ctx.arrival, ctx.num_instances)
    client = part_client(settings, ctx, wid)
    try:
        client.hello(0)
    except BaseException:
        client.close()
        raise
    wave = client.clocks[0]
    log.warning(
        "virtual worker %d stage %d %s as worker %d at wave %d (step %d)",
        ctx.instance, ctx.stage, "comes back" if ctx.join else "resumes", wid, wave,
        wave * (int(settings.s_local) + 1),
    )  # fmt: skip
    return client, wave


class HetPipeStage:
    """``hetpipe``'s stage side (``sync/stage_plug.py``): this stage as part ``stage`` of virtual
    worker ``instance`` on the launcher's parameter servers (``services["ps"]``), its runtime's
    waves synchronised by a :class:`WaveSync`.  :meth:`finish` checks SPEC §2's bounds on the
    stage's own records and fails the run on a violation.

    **Data.**  Each VW trains its part of every step's global batch.  Which part is shard 0's
    data view of the step's wave (``ps/data_views.py``: the VWs the shards count, sorted; a VW
    evicted at clock t leaves the waves from a later start to the others, its slices in between
    listed as dropped), as a PS worker splits its clocks: :meth:`split_of`.  The split of wave j
    is read at the forward of its first minibatch, after the pull of clock j - 1 was answered (the
    gate of minibatch jW - 1), so the VW's wave j - 2 was committed: no data view made later can
    start at or before j (``ps/data_views.py`` says why), and every stage of the VW -- the first
    reads the inputs, the last the targets -- splits it the same way.  A receive posted ahead
    (``pipeline/stage_comm.py`` prefetches) may be for a wave whose split is not final yet, so
    the plug asks for sized messages: each activation and gradient carries its batch size.
    """

    def __init__(self, settings: Any, ctx: StageContext, joined: VWPartClient | None = None) -> None:
        self.wsp = WSP(s_local=int(settings.s_local), clock_distance=int(settings.clock_distance))
        self.instance, self.stage = ctx.instance, ctx.stage
        self.worker_id = worker_id_of(ctx.instance, ctx.arrival, ctx.num_instances)
        if joined is None:
            log.info(
                "virtual worker %d stage %d: parameter servers at %s",
                ctx.instance, ctx.stage, ", ".join(str(a) for a in ctx.services["ps"]),
            )  # fmt: skip
            joined = part_client(settings, ctx, self.worker_id)
            joined.hello(0)
        self.client = joined
        first_wave = self.client.clocks[0]  # (hello: one clock on every shard)
        if ctx.first_step != first_wave * self.wsp.wave_size:
            raise FlotillaError(
                f"virtual worker {ctx.instance}: starts at step {ctx.first_step}, not at wave {first_wave}"
            )
        plan = WavePlan(s_local=self.wsp.s_local, num_minibatches=ctx.num_minibatches, first_wave=first_wave)
        self.sync = WaveSync(
            ctx.runtime, self.client, plan, vw=ctx.instance, num_vws=ctx.num_instances, keys=ctx.model_keys
        )
        self.num_instances, self.wave_size = ctx.num_instances, plan.wave_size
        ctx.data.split = self.split_of
        if first_wave:  # (coming back, resumed: the global weights of its first wave's clock, gated)
            self.sync.start_from(self._pull(first_wave, ctx.model_keys))

    def _pull(self, clock: int, keys: Mapping[str, str]) -> PulledWave:
        params = dict(self.sync.runtime.module.named_parameters())
        out = {keys[n]: torch.empty_like(p.detach()) for n, p in params.items()}
        self.client.pull(clock, out)
        held = [self.client.read_c_global[s] for s in self.client.own_shards]
        return PulledWave(clock=clock, weights=out, c_global=min(held))

    def split_of(self, step: int) -> tuple[int, int]:
        """``(part, parts)`` of ``step``'s global batch this VW trains (class doc); before shard 0's
        first data view (every VW joined), the job's first VWs in order."""
        got = split_of(self.client.data_views[1], step // self.wave_size, self.worker_id)
        if got is None:
            return self.instance, self.num_instances
        rank, world, start = got
        if rank < 0:
            raise FlotillaError(
                f"virtual worker {self.instance} is not in the parameter servers' data view of wave "
                f"{step // self.wave_size} (from wave {start}): it was evicted"
            )
        return rank, world

    def finish(self) -> dict[str, Any]:
        try:
            self.sync.finish()
        finally:
            self.client.close()
        records = self.sync.records
        bad = check_sglobal_bound(records, self.wsp) + check_slocal_bound(records, self.wsp)
        if bad:
            v = bad[0]
            raise FlotillaError(
                f"virtual worker {self.instance} stage {self.stage}: minibatch {v.minibatch} ran without "
                f"the {v.kind} updates {list(v.missing)[:4]} (vw, wave) SPEC §2's bound requires "
                f"(s_local {self.wsp.s_local}, D {self.wsp.clock_distance}); {len(bad)} violation(s)"
            )
        return {
            "hetpipe": {
                "vw": self.instance,
                "minibatches_checked": len(records),
                "max_staleness": max_observed_staleness(records),
                "s_global": s_global(self.wsp),
                "gate_waits": self.sync.waits,
                "gate_wait_s": round(self.sync.waited_s, 6),
            }
        }
