"""What happens at a step boundary (pure): advance, redo, drop or skip the unit; recover from a
broken group; change view; checkpoint, evaluate, flush records; switch strategy; stop.

``decide(policy, state, report) -> Boundary`` is the whole rule; the loop (``trainer/loop.py``)
only executes what it returns, and the simulator can call it with modelled times.  No torch, no
I/O, no clock: the time of the boundary comes in with the report (``now_s``).

The rules
- A unit whose group broke (``broken``) is discarded: ``redo`` keeps the step (the default),
  ``drop`` goes on with the next one; either way the worker recovers into a new view first.
- A unit discarded for a non-finite loss or gradient (on any member: the barrier's vote carries
  it) stops the job (``on_nonfinite: stop``, the default) -- the model keeps the last finite
  weights, since nothing of the unit was applied -- or is skipped and counted
  (``on_nonfinite: skip``) until more than ``max_nonfinite`` were skipped.
- A unit discarded for an fp16 overflow (``overflow``: the loss scale was too large; agreed under
  a vote, ``sync/scaler.py``) is skipped like a non-finite one but not counted and never stops
  the job: the scale backed off, training goes on (``overflow_skipped`` counts them).  More than
  ``MAX_OVERFLOWS_IN_A_ROW`` in a row is no overflow the scale can cure (it halves each time: 40
  halvings take 2**16 to the floor 2**-24) but gradients that are not finite at any scale: that
  unit is a non-finite one (counted, and ``on_nonfinite`` applies).
- Any other discarded unit (a member's injected fault) is redone or dropped (``on_abort``).
- A committed unit advances the step.  Then, in this order: an agreed stop ends the loop; an
  agreed membership change (``pending_epoch`` newer than the current view) is made; an agreed
  strategy switch (``switch``, from the vote) or a planned one (``SwitchAt``: a step announced in
  advance; a unit of several steps switches at its end, the first boundary at or past it) takes
  effect at the new step on every worker.  (A planned step passed by a unit that did not commit
  is caught up by the loop machine before the next unit.)
- Checkpoint: rank 0 (every rank with ``duties_on_every_rank``: pipeline stages each hold their
  own layers), after a committed unit, whenever the step crossed a multiple of
  ``checkpoint_every_steps`` since the last checkpoint, or once ``checkpoint_every_s`` passed
  since the last one; ``local_checkpoint``: on every rank when the steps rule falls due (the same
  on every rank), so each saves its own local state beside rank 0's checkpoint.  Evaluation:
  rank 0, every ``eval_every_units`` units, or whenever the step crosses a multiple of
  ``eval_every_steps`` (units may span several steps: ``ps`` under WSP, ``diloco``), after a
  commit or a drop, never at the last step (the final evaluation follows).  Records are flushed
  at the last step and before a view change.

Invariants (tests/unit/test_boundary.py, property tests): the step never decreases and never
passes ``total_steps``; a unit that did not commit never checkpoints, switches or changes view;
every worker fed the same agreed report decides the same thing (rank only gates rank-0 duties).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

__all__ = [
    "Action",
    "Boundary",
    "BoundaryPolicy",
    "LoopState",
    "MAX_OVERFLOWS_IN_A_ROW",
    "StopReason",
    "SwitchAt",
    "UnitReport",
    "decide",
]

MAX_OVERFLOWS_IN_A_ROW = 64  # fp16 overflows in a row before a unit counts as non-finite (module doc)


class Action(Enum):
    ADVANCE = "advance"  # committed: next step
    REDO = "redo"  # discarded: the same step again
    DROP = "drop"  # discarded: its samples are lost, next step
    SKIP = "skip"  # discarded for a non-finite value, skipped and counted


class StopReason(Enum):
    FINISHED = "finished"
    REQUESTED = "requested"  # the coordinator (or a member) asked to stop at this boundary
    NONFINITE = "nonfinite"
    NONFINITE_LIMIT = "nonfinite_limit"


@dataclass(frozen=True, slots=True)
class SwitchAt:
    """A switch fixed in advance: from step ``step`` on, every worker runs option ``option``
    (1-based index into the job's switch options)."""

    step: int
    option: int

    def __post_init__(self) -> None:
        if self.step < 0 or self.option < 1:
            raise ValueError(f"SwitchAt needs step >= 0 and option >= 1, got {self.step}, {self.option}")


@dataclass(frozen=True, kw_only=True, slots=True)
class BoundaryPolicy:
    total_steps: int
    on_abort: str = "redo"
    on_nonfinite: str = "stop"
    max_nonfinite: int = 10
    eval_every_units: int = 0
    eval_every_steps: int = 0  # (units of several steps: evaluate when the step crosses a multiple)
    checkpoint_every_steps: int = 0
    checkpoint_every_s: float = 0.0
    switch_plan: tuple[SwitchAt, ...] = ()
    duties_on_every_rank: bool = False  # checkpoint/evaluate on every rank (pipeline stages)

    def __post_init__(self) -> None:
        if self.on_abort not in ("redo", "drop"):
            raise ValueError(f"on_abort must be one of redo, drop; got {self.on_abort!r}")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite must be one of stop, skip; got {self.on_nonfinite!r}")
        if min(self.total_steps, self.max_nonfinite, self.eval_every_units, self.eval_every_steps) < 0:
            raise ValueError("total_steps, max_nonfinite, eval_every_units and eval_every_steps must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoopState:
    step: int = 0  # the next step to run
    units: int = 0  # units committed or dropped so far (evaluation cadence)
    nonfinite_skipped: int = 0
    overflow_skipped: int = 0  # units skipped for an fp16 overflow (not non-finite ones)
    overflows_in_a_row: int = 0  # since the last unit that was not an overflow
    last_checkpoint_step: int = 0
    last_checkpoint_s: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitReport:
    """One unit as the loop saw it: its steps ``[first_step, last_step]``, this worker's rank and
    view epoch, and the strategy's (agreed) outcome."""

    first_step: int
    last_step: int
    rank: int
    epoch: int
    committed: bool
    broken: bool = False
    local_ok: bool = True
    pending_epoch: int = 0
    stop: bool = False
    switch: int = 0
    now_s: float = 0.0
    overflow: bool = False  # fp16: discarded for an overflow of the loss scale, not a non-finite value


@dataclass(frozen=True, kw_only=True, slots=True)
class Boundary:
    state: LoopState
    action: Action
    recover: bool = False
    change_view: int = 0  # the epoch to move to (0: none)
    checkpoint: bool = False
    local_checkpoint: bool = False  # every rank: save its own local state (the steps rule fell due)
    evaluate: bool = False
    flush_records: bool = False
    switch_to: int = 0  # option to switch to from ``state.step`` on (0: none)
    stop: StopReason | None = None


def decide(policy: BoundaryPolicy, state: LoopState, r: UnitReport) -> Boundary:
    """The boundary after unit ``r`` (see the module doc)."""
    if r.last_step < r.first_step or r.first_step != state.step:
        raise ValueError(f"unit [{r.first_step}, {r.last_step}] does not start at step {state.step}")
    if r.broken:
        return _discarded(policy, state, r, recover=True)
    if not r.committed and not r.local_ok:
        return _nonfinite(policy, replace(state, overflows_in_a_row=0), r)
    if not r.committed and r.overflow:
        if state.overflows_in_a_row >= MAX_OVERFLOWS_IN_A_ROW:  # (module doc: not curable)
            return _nonfinite(policy, replace(state, overflows_in_a_row=0), r)
        return _overflowed(policy, state, r)
    state = replace(state, overflows_in_a_row=0) if state.overflows_in_a_row else state
    if not r.committed:
        return _discarded(policy, state, r, recover=False)
    nxt = replace(state, step=min(r.last_step + 1, policy.total_steps), units=state.units + 1)
    by_steps = _checkpoint_steps_due(policy, nxt)
    on_duty = r.rank == 0 or policy.duties_on_every_rank
    checkpoint = on_duty and (by_steps or _checkpoint_time_due(policy, nxt, r.now_s))
    local = by_steps and not policy.duties_on_every_rank
    if checkpoint or local:
        nxt = replace(nxt, last_checkpoint_step=nxt.step, last_checkpoint_s=r.now_s)
    change = r.pending_epoch if r.pending_epoch > r.epoch else 0
    return Boundary(
        state=nxt,
        action=Action.ADVANCE,
        change_view=0 if r.stop else change,
        checkpoint=checkpoint,
        local_checkpoint=local,
        evaluate=_eval_due(policy, state, nxt, r.rank),
        flush_records=nxt.step >= policy.total_steps or change > 0,
        switch_to=0 if r.stop else _switch(policy, state.step, nxt.step, r.switch),
        stop=_stop_after(policy, nxt, r),
    )


def _discarded(policy: BoundaryPolicy, state: LoopState, r: UnitReport, *, recover: bool) -> Boundary:
    if policy.on_abort == "redo":
        return Boundary(state=state, action=Action.REDO, recover=recover, stop=_requested(r))
    nxt = replace(state, step=min(r.last_step + 1, policy.total_steps), units=state.units + 1)
    return Boundary(
        state=nxt,
        action=Action.DROP,
        recover=recover,
        evaluate=not recover and _eval_due(policy, state, nxt, r.rank),
        stop=_stop_after(policy, nxt, r),
    )


def _nonfinite(policy: BoundaryPolicy, state: LoopState, r: UnitReport) -> Boundary:
    if policy.on_nonfinite == "stop":
        return Boundary(state=state, action=Action.REDO, stop=StopReason.NONFINITE)
    skipped = state.nonfinite_skipped + 1
    nxt = replace(state, step=min(r.last_step + 1, policy.total_steps), nonfinite_skipped=skipped)
    if skipped > policy.max_nonfinite:
        return Boundary(state=nxt, action=Action.SKIP, stop=StopReason.NONFINITE_LIMIT)
    return Boundary(state=nxt, action=Action.SKIP, stop=_stop_after(policy, nxt, r))


def _overflowed(policy: BoundaryPolicy, state: LoopState, r: UnitReport) -> Boundary:
    """An fp16 overflow: the unit is skipped (its samples are not trained again), not counted as
    non-finite; evaluation keeps its cadence as after a drop."""
    nxt = replace(
        state,
        step=min(r.last_step + 1, policy.total_steps),
        units=state.units + 1,
        overflow_skipped=state.overflow_skipped + 1,
        overflows_in_a_row=state.overflows_in_a_row + 1,
    )
    return Boundary(
        state=nxt,
        action=Action.SKIP,
        evaluate=_eval_due(policy, state, nxt, r.rank),
        stop=_stop_after(policy, nxt, r),
    )


def _requested(r: UnitReport) -> StopReason | None:
    return StopReason.REQUESTED if r.stop else None


def _stop_after(policy: BoundaryPolicy, nxt: LoopState, r: UnitReport) -> StopReason | None:
    if r.stop:
        return StopReason.REQUESTED
    return StopReason.FINISHED if nxt.step >= policy.total_steps else None


def _checkpoint_steps_due(policy: BoundaryPolicy, nxt: LoopState) -> bool:
    """The same on every rank: a multiple of ``checkpoint_every_steps`` crossed since the last
    checkpoint (units may span several steps)."""
    every = policy.checkpoint_every_steps
    last = nxt.last_checkpoint_step
    return nxt.step > last and every > 0 and nxt.step // every > last // every


def _checkpoint_time_due(policy: BoundaryPolicy, nxt: LoopState, now_s: float) -> bool:
    """Rank 0's clock: ``checkpoint_every_s`` passed since the last checkpoint."""
    if nxt.step <= nxt.last_checkpoint_step:
        return False
    return policy.checkpoint_every_s > 0 and now_s - nxt.last_checkpoint_s >= policy.checkpoint_every_s


def _eval_due(policy: BoundaryPolicy, before: LoopState, nxt: LoopState, rank: int) -> bool:
    if not (rank == 0 or policy.duties_on_every_rank) or nxt.step >= policy.total_steps:
        return False
    units, steps = policy.eval_every_units, policy.eval_every_steps
    by_units = units > 0 and nxt.units % units == 0
    return by_units or (steps > 0 and nxt.step // steps > before.step // steps)


def _switch(policy: BoundaryPolicy, before: int, after: int, agreed: int) -> int:
    """An agreed switch, else the last one planned for a step this unit reached or passed (a unit
    of several steps switches at its end: the first boundary at or after the planned step)."""
    if agreed > 0:
        return agreed
    planned = [s for s in policy.switch_plan if before < s.step <= after]
    return max(planned, key=lambda s: s.step).option if planned else 0
