"""Stage runtime: one pipeline stage executes its action list of a ``Schedule`` (SPEC §3.3).

A ``StageRuntime`` owns one stage module, its optimizer and a ``WeightStash``, and runs
``schedule.stages[stage_idx]`` strictly in order (the execution model of
``flotilla.pipeline.timeline``):

- ``Forward(b, v)`` / ``Backward(b, v)``: compute with weight version v.  Passes the stash plan
  (``stash_plan.plan_stash``) marks as LIVE use the module's parameters directly (GPipe, 1F1B, and PipeDream
  passes with no update in between); the others run ``functional_call`` on the stashed tensors of
  version v (``flotilla.pipeline.stage_pass``, the compute of one pass), so the backward of b
  uses exactly the weights its forward used.  The last stage adds
  ``loss_fn(output, target) * loss_scale(b)``; the scaled microbatch losses of a minibatch sum to
  its mean loss, so flushed gradients equal single-process gradients on the whole minibatch.
  With ``scale_loss`` (fp16's loss scale, set by the stage engine) the loss the backward starts
  from is multiplied by it, in float32 (the recorded loss is not), so every gradient sent upstream
  and every stage's parameter gradients are scaled; they travel in the boundary's dtype.
- ``SendAct``/``SendGrad``/``RecvAct``/``RecvGrad``: ``flotilla.pipeline.runtime_messages`` through
  ``flotilla.pipeline.stage_comm``
  (asynchronous sends over the stage's ``EpochGroup``, rank == stage_idx; receives posted
  ``prefetch_recvs`` actions ahead; each directed link FIFO; waits bounded by the group's timeout).
- ``OptimizerStep(v, v+1)``: ``optimizer.step()`` on the accumulated gradients, after the stash
  preserved v if a later action still names it.  An ``update_guard(v)`` that names a non-finite
  value skips the step (the gradients are dropped, version v+1 holds v's weights) and may set
  ``halted`` to end the run after this action.
- Non-finite values: the last stage marks a minibatch whose loss is not finite; with
  ``check_grads_in`` a stage also marks a minibatch whose received gradient is not finite and
  sends NaN gradients upstream for it, so every stage learns of it before its own update of that
  minibatch (``nonfinite_of``).
- A run is ``begin(schedule)``, ``advance(stop)`` over slices of the action list (a flush, or the
  whole list), ``end()``; ``run(schedule)`` is the three at once.
- Vertical sync: with ``schedule.vertical_sync`` every activation carries its minibatch's version
  tag (a one-element message on its own tag); a stage refuses (``ScheduleError``) a tag that
  differs from the version its action list names.

Invariants checked while running (``ScheduleError`` on violation): a pass names the version its
stash holds, a backward names its forward's version, at most the schedule's in-flight microbatches
are held.  Instrumentation (``flotilla.pipeline.instrument``): a measured timeline
``(stage_idx, action, start_s, end_s)``, per pass the version used (and, with ``record_versions``,
a digest of the weights actually used, plus the digest of every version the stage created), peak
in-flight microbatches, peak weight copies, and (``track_memory``) the peak bytes of activations
held for pending backwards, counted through autograd's saved-tensor hooks (weights excluded).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from flotilla.cluster.emulation import SpeedEmulator
from flotilla.comm.collective import Group
from flotilla.pipeline.instrument import SavedBytes, StageResult, VersionRecord, saved_hooks, weights_digest
from flotilla.pipeline.runtime_inputs import RuntimeOptions, StageData
from flotilla.pipeline.runtime_messages import StageMessages
from flotilla.pipeline.schedule import (
    Action,
    Backward,
    Forward,
    OptimizerStep,
    Schedule,
    SendAct,
    SendGrad,
    format_action,
)
from flotilla.pipeline.split import ActivationSpec
from flotilla.pipeline.stage_comm import StageComm
from flotilla.pipeline.stage_pass import StagePass, backward_pass, stashed_forward, weight_ptrs
from flotilla.pipeline.stash import WeightStash
from flotilla.pipeline.stash_plan import peak_in_flight, plan_stash
from flotilla.pipeline.timeline import ScheduleError, TimelineEntry

__all__ = [
    "RuntimeOptions",
    "peak_in_flight",
    "StageData",
    "StageResult",
    "StageRuntime",
    "VersionRecord",
    "weights_digest",
]


class StageRuntime(StageMessages):
    """Executes one stage's actions; see the module docstring."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        stage_idx: int,
        group: Group | None,
        data: StageData,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        in_spec: ActivationSpec | None,
        out_spec: ActivationSpec | None,
        options: RuntimeOptions = RuntimeOptions(),
        emulator: SpeedEmulator | None = None,
        clock: Callable[[], float] = time.perf_counter,
        autocast: Callable[[], AbstractContextManager[object]] = nullcontext,
        device: torch.device | None = None,
    ) -> None:
        """``autocast``: the context of the forward passes and the loss (``job.precision``); an
        activation leaves the stage in its boundary's dtype (``out_spec``), cast in the graph.
        ``device``: where the stage computes (default: its parameters' device, else the CPU)."""
        self.module, self.optimizer, self.stage_idx = module, optimizer, stage_idx
        self.autocast = autocast
        self.group, self.data, self.loss_fn = group, data, loss_fn
        self.in_spec, self.out_spec, self.options = in_spec, out_spec, options
        self.emulator, self.clock = emulator, clock
        self.names = [name for name, _ in module.named_parameters()]
        # where this stage computes: its parameters' device (microbatches and targets move there)
        own = next((p.device for p in module.parameters()), torch.device("cpu"))
        self.device = device if device is not None else own
        self.stash = WeightStash([p for _, p in module.named_parameters()])
        self.on_step: Callable[[int, float | None, int], None] | None = None
        self.before_update: Callable[[int, nn.Module], None] | None = None
        # after the optimizer changed the live weights of update v (skipped or not), before v+1
        # is recorded: the hook may change them further (a HetPipe stage folds in pulled global
        # weights there, so the weight stash's copy-on-write covers that change too)
        self.after_update: Callable[[int, nn.Module], None] | None = None
        # before each Forward (its microbatch index), outside the timed compute (it may wait)
        self.before_forward: Callable[[int], None] | None = None
        self.update_guard: Callable[[int], str] | None = None
        # fp16: the loss a last stage's backward starts from (its loss times the loss scale)
        self.scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.halted = False

    # ------------------------------------------------------------------ driver
    def run(self, schedule: Schedule) -> StageResult:
        """Execute ``schedule.stages[stage_idx]``; returns the instrumentation.  ``run`` may be called
        again with another schedule: versions are numbered per run (version 0 = the weights when the
        run starts; a completed run leaves nothing stashed)."""
        self.begin(schedule)
        self.advance(len(self.actions))
        return self.end()

    def begin(self, schedule: Schedule) -> None:
        """Start a run of ``schedule`` whose actions :meth:`advance` executes in slices (a flush,
        or the whole list); :meth:`end` closes it."""
        self.schedule, self.actions = schedule, schedule.stages[self.stage_idx]
        self.stash = WeightStash(self.stash.params)
        self.last = self.stage_idx == schedule.num_stages - 1
        self.plan = plan_stash(self.actions)
        self.max_in_flight = peak_in_flight(self.actions)
        self.passes: dict[int, StagePass] = {}
        self.inputs: dict[int, torch.Tensor] = {}
        self.grads_in: dict[int, torch.Tensor] = {}
        self.grads_out: dict[int, torch.Tensor] = {}
        self.tags_in: dict[int, int] = {}
        self.comm = StageComm(
            self.group,
            stage_idx=self.stage_idx,
            actions=self.actions,
            specs=(self.in_spec, self.out_spec),
            batch_size=self.data.batch_size,
            prefetch=self.options.prefetch_recvs,
            vertical_sync=schedule.vertical_sync,
            device=self.device,
            sized=self.options.sized_messages,
        )
        self.in_flight_bytes = 0
        self.step_losses: dict[int, float] = {}
        self.nonfinite: dict[int, str] = {}
        self.next_action, self.halted = 0, False
        self.result = StageResult(stage_idx=self.stage_idx)
        if self.options.record_versions:
            self.result.version_digests[0] = weights_digest(self.stash.params)
        self._start = self.clock()
        if self.emulator is not None:
            self.emulator.reset_counters()

    def elapsed_s(self) -> float:
        """Seconds since :meth:`begin` (0 before the first)."""
        return self.clock() - self._start if hasattr(self, "_start") else 0.0

    def advance(self, stop: int) -> bool:
        """Execute the actions up to index ``stop`` (exclusive); False if :attr:`halted` was set
        (by ``update_guard``) and the run stopped early."""
        actions, comm = self.actions, self.comm
        while self.next_action < stop and not self.halted:
            idx = self.next_action
            comm.post_recvs()
            self._execute(idx, actions[idx])
            self._release_versions(idx, actions[idx])
            self.next_action = idx + 1
        return not self.halted

    def end(self) -> StageResult:
        """Close the run: wait for the sends in flight (not after a halt: a halted peer may never
        receive them) and return the instrumentation."""
        if not self.halted:
            self.comm.drain(wait=True)
        self.result.wall_s = self.clock() - self._start
        self.result.peak_weight_copies = self.stash.peak_copies
        self.result.step_losses = self.step_losses
        if self.emulator is not None:
            self.result.compute_s, self.result.slept_s = self.emulator.compute_s, self.emulator.slept_s
        return self.result

    def amend_newest(self, change: Callable[[], None]) -> None:
        """Run ``change`` (it changes the live, newest weights in place, under ``no_grad``) before
        any pass used the newest version -- e.g. from ``before_forward`` right after an update: a
        HetPipe stage folds pulled global weights in there.  Refused (``ScheduleError``) while a
        pass in flight ran with the newest version (its backward would see other weights)."""
        newest = self.stash.newest
        if any(p.version == newest for p in self.passes.values()):
            raise ScheduleError(f"stage {self.stage_idx}: version {newest} is in use; it cannot change now")
        with torch.no_grad():
            change()
        if self.options.record_versions:
            self.result.version_digests[newest] = weights_digest(self.stash.params)

    def unit_ends(self) -> list[int]:
        """For each update of the action list, the index just after its ``OptimizerStep`` (for a
        flushing schedule: where minibatch k's flush ends)."""
        return [i + 1 for i, a in enumerate(self.actions) if isinstance(a, OptimizerStep)]

    def nonfinite_of(self, minibatch: int) -> str:
        """What was found not finite for ``minibatch`` on this stage: ``"loss"`` (last stage), or
        ``"gradient"`` (a received gradient, with ``check_grads_in``), else ``""``."""
        return self.nonfinite.get(minibatch, "")

    def _execute(self, idx: int, action: Action) -> None:
        skip = ""  # the guard may wait for the other stages: outside the timed (and emulated) compute
        if isinstance(action, OptimizerStep) and self.update_guard is not None:
            skip = self.update_guard(action.reads_version)
        if isinstance(action, Forward) and self.before_forward is not None:
            self.before_forward(action.microbatch_idx)  # (it may wait: outside the timed compute too)
        begin = self.clock()
        if isinstance(action, (Forward, Backward, OptimizerStep)):
            if self.emulator is not None:
                self.emulator.start()
            if isinstance(action, Forward):
                self._forward(action)
            elif isinstance(action, Backward):
                self._backward(action)
            else:
                self._update(idx, action, skip)
            if self.emulator is not None:
                if self.emulator.stretches and self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # (a slower device: from finished compute)
                self.emulator.mark()
        elif isinstance(action, (SendAct, SendGrad)):
            self._send(action)
        else:
            self._recv(action)
        if self.options.record_timeline:
            self.result.timeline.append(TimelineEntry(self.stage_idx, action, begin, self.clock()))

    # ------------------------------------------------------------------ compute
    def _forward(self, action: Forward) -> None:
        b, v = action.microbatch_idx, action.weight_version
        if self.stage_idx == 0:
            x, inp = self.data.input(b).to(self.device, non_blocking=True), None
        else:
            x = inp = self.inputs.pop(b)
            if x.is_floating_point():  # (an integer activation gets no gradient: stage_pass.py)
                x.requires_grad_(True)
            tag = self.tags_in.pop(b, None)
            if tag is not None and tag != v:
                raise ScheduleError(
                    f"stage {self.stage_idx}: minibatch {b} arrived tagged with version {tag}, "
                    f"the schedule names version {v} (vertical sync)"
                )
        counter = SavedBytes(weight_ptrs(self.stash)) if self.options.track_memory else None
        leaves = None
        with saved_hooks(counter), self.autocast():
            if b in self.plan.stashed:
                out, leaves = stashed_forward(self.module, self.names, self.stash, v, x)
            else:
                if v != self.stash.newest:
                    raise ScheduleError(
                        f"stage {self.stage_idx}: {format_action(action)} on live weights "
                        f"of version {self.stash.newest}"
                    )
                out = self.module(x)
            if not self.last and self.out_spec is not None and out.dtype != self.out_spec.dtype:
                out = out.to(self.out_spec.dtype)  # (mixed precision: the boundary's dtype travels)
            if self.last:
                target = self.data.target(b).to(self.device, non_blocking=True)
                loss = self.loss_fn(out, target) * self.data.loss_scale(b)
                k = self.schedule.minibatch_of(b)
                value = float(loss.detach())
                self.step_losses[k] = self.step_losses.get(k, 0.0) + value
                if not math.isfinite(value):
                    self.nonfinite[k] = "loss"
                out = loss if self.scale_loss is None else self.scale_loss(loss)
        act_bytes = 0
        if counter is not None:
            counter.add(out)
            if inp is not None:
                counter.add(inp)
            act_bytes = counter.total
        digest = self._record("F", b, v, leaves)
        self.passes[b] = StagePass(
            inp=inp, out=out, leaves=leaves, version=v, digest=digest, act_bytes=act_bytes
        )
        self._note_in_flight(act_bytes)

    def _backward(self, action: Backward) -> None:
        b, v = action.microbatch_idx, action.weight_version
        ctx = self.passes.pop(b, None)
        if ctx is None or ctx.version != v:
            got = None if ctx is None else ctx.version
            raise ScheduleError(
                f"stage {self.stage_idx}: {format_action(action)} but the forward used version {got}"
            )
        grad_out = None if self.last else self.grads_in.pop(b)
        digest = self._record("B", b, v, ctx.leaves)
        if self.options.record_versions and digest != ctx.digest:
            raise ScheduleError(
                f"stage {self.stage_idx}: weights of version {v} changed between F{b} and B{b}"
            )
        grad_in = backward_pass(ctx, grad_out, self.stash.params)
        if self.stage_idx > 0:  # (zeros for an input without a gradient: the schedule sends one)
            assert ctx.inp is not None  # (every stage but the first has an input)
            self.grads_out[b] = grad_in if grad_in is not None else torch.zeros_like(ctx.inp)
        self.in_flight_bytes -= ctx.act_bytes

    def _update(self, idx: int, action: OptimizerStep, skip: str) -> None:
        v = action.reads_version
        if v != self.stash.newest:
            raise ScheduleError(
                f"stage {self.stage_idx}: {format_action(action)} but the newest version is "
                f"{self.stash.newest}"
            )
        if self.before_update is not None:
            self.before_update(v, self.module)
        self.stash.before_update(keep_current=self.plan.needed_after(v, idx))
        if not skip:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.after_update is not None:
            self.after_update(v, self.module)
        self.stash.after_update()
        if self.options.record_versions:
            self.result.version_digests[v + 1] = weights_digest(self.stash.params)
        if self.on_step is not None:
            m = self.schedule.num_microbatches
            samples = sum(self.data.batch_size(b) for b in range(v * m, (v + 1) * m))
            self.on_step(v, self.step_losses.get(v) if self.last else None, samples)

    # ------------------------------------------------------------------ bookkeeping
    def _release_versions(self, idx: int, action: Action) -> None:
        if isinstance(action, (Forward, Backward)) and self.plan.is_last_use(action.weight_version, idx):
            self.stash.release(action.weight_version)

    def _note_in_flight(self, act_bytes: int) -> None:
        n = len(self.passes)
        if n > self.max_in_flight:
            raise ScheduleError(f"stage {self.stage_idx}: {n} microbatches in flight > {self.max_in_flight}")
        self.in_flight_bytes += act_bytes
        self.result.peak_in_flight = max(self.result.peak_in_flight, n)
        self.result.peak_activation_bytes = max(self.result.peak_activation_bytes, self.in_flight_bytes)
        self.stash.note_peak()

    def _record(self, kind: str, b: int, v: int, leaves: tuple[torch.Tensor, ...] | None) -> str | None:
        used = self.stash.newest if leaves is None else v
        digest = None
        if self.options.record_versions:
            digest = weights_digest(leaves if leaves is not None else self.stash.params)
        self.result.versions.append(VersionRecord(kind, b, v, used, digest))
        return digest
