"""The training loop as a pure step machine: ``step(state, event) -> (state, effects)``.

Every decision of the loop lives here; ``trainer/loop.py`` only carries out the effects
(``loop_events.py``) and feeds back the answers, and a simulator can drive the same machine with
modelled answers.  No torch, no I/O, no clock: the time comes in with the events.

The one thing it reads of a strategy is its declaration (``sync.base.Terms``): its regime and the
minibatches per commit unit.  Per regime:

- ``VOTE``: entering a view binds its group and agrees on the state; before each unit the pending
  epoch, the coordinator's stop and a requested switch are proposed in the unit's vote, so every
  member changes view, stops or switches at the same step; a failed move recovers in the view.
- ``GROUPS``: a worker stops or leaves alone; before each unit it catches up (reports a broken
  view, takes the next one, never waits); where the strategy takes newcomers, it also moves to a
  newer view (a join) at its next boundary on its own, as under ``ALONE``.
- Whatever the regime, a worker that joins after the start without the state is refused unless
  the strategy's terms take newcomers (``Terms.takes_newcomers``: it fills them on its own).
- ``ALONE``: a worker stops or leaves alone and moves to a newer view at its next boundary on its
  own; a move that fails is retried at the next boundary while it trains on in its view.

Per unit: ``Poll`` -> (``CatchUp``) -> ``RunUnit`` -> ``decide`` (``trainer/boundary.py``) ->
records, step, duties -> stop / recover / change view / switch -> ``BoundaryDone``.  A strategy
switch (agreed in a vote, planned for a step: ``BoundaryPolicy.switch_plan``, or announced at run
time: ``Polled.announced``) closes the running strategy, builds the next one and enters the view
with it: under a vote on every member at the same step; without one, each worker at the step
(one that learns of an announcement after passing it, at once).

Invariants (``tests/unit/test_loop_machine.py``, property tests): the step never goes back nor
past the total; a unit that did not commit gets no checkpoint, no view change and no agreed switch
(it is evaluated only when dropped, ``on_abort: drop``: its step advanced; a planned or announced
step it passed is switched at the next boundary); fed the same answers, every rank takes the same
decisions (rank only gates rank-0 duties); a switch happens at the announced step.  The state
itself (its fields, the phases) is ``trainer/loop_state.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from flotilla.sync.base import Proposal, Regime
from flotilla.trainer import loop_events as ev
from flotilla.trainer.boundary import (
    Action,
    BoundaryPolicy,
    LoopState,
    StopReason,
    SwitchAt,
    UnitReport,
    decide,
)
from flotilla.trainer.loop_state import EXIT_NONFINITE, EXIT_ORPHANED, Machine, Phase

__all__ = ["EXIT_NONFINITE", "EXIT_ORPHANED", "Machine", "Phase", "start", "step"]

Out = tuple[Machine, list[ev.Effect]]


def start(policy: BoundaryPolicy, worker: int) -> Out:
    return Machine(policy=policy, worker=worker), [ev.AskFirstView()]


def step(s: Machine, e: ev.Event) -> Out:
    """The machine's answer to event ``e`` (a ``ValueError`` for an event it does not wait for)."""
    phase, handler = _HANDLERS.get(type(e), (None, None))
    if phase is not s.phase or handler is None:  # (each event answers the queries of one phase)
        raise ValueError(f"loop machine: event {type(e).__name__} while waiting in phase {s.phase.name}")
    return handler(s, e)


# ---------------------------------------------------------------------- views and strategies
def _first_view(s: Machine, e: ev.FirstView) -> Out:
    if e.view is None:
        return _end(s, [ev.Exit(0)])
    v = e.view
    s = s._replace(epoch=v.epoch, rank=v.rank, world=v.world_size, step=e.step, has_state=e.has_state)
    if e.initial:
        return s._replace(phase=Phase.RESTORE), [ev.Restore()]
    return _build_first(s)


def _restored(s: Machine, e: ev.Restored) -> Out:
    return _build_first(s._replace(step=e.step, has_state=True))


def _build_first(s: Machine) -> Out:
    """The job's strategy, or the last one its switch plan names for a step up to this one."""
    planned = [sw for sw in s.policy.switch_plan if sw.step <= s.step]
    option = max(planned, key=lambda sw: sw.step).option if planned else 0
    return s._replace(phase=Phase.BUILD, option=option, plan_at=s.step), [ev.Build(option)]


def _built(s: Machine, e: ev.Built) -> Out:
    t = e.terms
    s = s._replace(regime=t.regime, k=t.steps_per_commit, name=t.name, newcomers=t.takes_newcomers)
    fx: list[ev.Effect] = []
    if s.switch_from:
        msg = f"worker {s.worker} switched strategy {s.switch_from} -> {s.name} at step {s.step}"
        fx.append(ev.Log("info", msg))
        s = s._replace(switch_from="")
    elif not e.terms.takes_newcomers and not s.has_state:
        msg = f"strategy {s.name} takes no newcomers (a fixed membership): this worker joined after the start"
        return _end(s, [ev.Refuse(msg)])
    return _enter(s, wanted=True, start=True, fx=fx)


def _enter(s: Machine, *, wanted: bool, start: bool, fx: list[ev.Effect] | None = None) -> Out:
    bind = s.regime is Regime.VOTE
    enter = ev.EnterView(s.epoch, bind=bind, wanted=wanted, start=start, average=bind and s.average)
    return s._replace(phase=Phase.ENTER, starting=start), [*(fx or []), enter]  # (average: until entered)


def _entered(s: Machine, e: ev.Entered) -> Out:
    fx: list[ev.Effect] = []
    at, has_state = e.step, e.has_state
    if s.starting and e.joined_at > at:  # (a mid-run joiner; a resumed ps job's shards' clock)
        why = "joined mid-run" if not has_state else "where its strategy's state stands"
        fx += [ev.Log("info", f"worker {s.worker} starts at step {e.joined_at} ({why})")]
        at = e.joined_at
        fx.append(ev.SetStep(at))
    msg = f"worker {s.worker} adopted view {s.epoch} (rank {s.rank} of {s.world}) at step {at}"
    fx.append(ev.Log("info", msg))
    if s.progress is None:
        progress = LoopState(step=at, units=at // s.k, last_checkpoint_step=at)
    else:  # (a donor may be ahead: it committed a step whose vote broke for others)
        progress = replace(s.progress, step=at)
    s = s._replace(step=at, has_state=has_state, starting=False, progress=progress, average=False)
    return _resume(s, fx)


def _enter_failed(s: Machine, e: ev.EnterFailed) -> Out:
    msg = f"view {s.epoch} could not form ({e.reason}); waiting for the next one"
    return s._replace(phase=Phase.RECOVER), [ev.Log("warning", msg), ev.CloseGroup(), ev.Recover(frozenset())]


def _view_given(s: Machine, e: ev.ViewGiven) -> Out:
    if e.view is None:
        return _out(s, "is out of the job")
    return _enter(_at(s, e.view), wanted=True, start=s.starting)


def _moved(s: Machine, e: ev.Moved) -> Out:
    if e.view is None:
        return _out(s, "left")
    return _enter(_at(s, e.view), wanted=e.view.joined, start=False)


def _move_failed(s: Machine, e: ev.MoveFailed) -> Out:
    if s.regime.barrier:  # the members meet in the view: recover there
        msg = f"transition to view {s.moving_to} failed: {e.reason}"
        return s._replace(phase=Phase.RECOVER), [ev.Log("warning", msg), ev.Recover(frozenset())]
    # Without a barrier nobody meets in a view: waiting here for the failure round could wait on
    # a member that itself waits on this worker (ps: in the consistency gate); train on, ask again.
    fx: list[ev.Effect] = []
    if s.moving_to != s.stayed:
        msg = f"worker {s.worker}: view {s.moving_to} not ready ({e.reason}); training on in view {s.epoch}"
        fx.append(ev.Log("info", msg))
        s = s._replace(stayed=s.moving_to)
    return _resume(s, fx)


def _switch(s: Machine, option: int, fx: list[ev.Effect]) -> Out:
    drifted = s.regime is not Regime.VOTE  # (its replicas are averaged if a vote comes next)
    s = s._replace(phase=Phase.BUILD, option=option, switch_from=s.name or "?", average=drifted)
    return s, [*fx, ev.CloseStrategy(), ev.Build(option)]


def _resume(s: Machine, fx: list[ev.Effect]) -> Out:
    """After a view formed (or a move was put off): the rest of the boundary, then the next unit."""
    if s.then_switch:
        option = s.then_switch
        return _switch(s._replace(then_switch=0), option, fx)
    if s.in_boundary:
        fx = [*fx, ev.BoundaryDone(s.step)]
    if s.step >= s.policy.total_steps:
        return _end(
            s._replace(in_boundary=False), [*fx, ev.Finish(s.step, s.rank, agreed=s.regime is Regime.VOTE)]
        )
    overdue = [sw for sw in s.policy.switch_plan if s.plan_at < sw.step <= s.step]
    plan_at = max(s.plan_at, s.step)
    if overdue and (option := max(overdue, key=lambda sw: sw.step).option) != s.option:
        # (a planned step passed by a unit that did not commit)
        return _switch(s._replace(in_boundary=False, plan_at=plan_at), option, fx)
    alone = not s.regime.barrier
    s = s._replace(in_boundary=False, plan_at=plan_at, phase=Phase.POLL)
    return s, [*fx, ev.Poll(propose=not alone, ask_done=alone and s.ran_unit)]


# ---------------------------------------------------------------------- units
def _polled(s: Machine, e: ev.Polled) -> Out:
    alone = not s.regime.barrier
    if alone and e.done:
        msg = f"worker {s.worker}: done at step {s.step} (its partners finished)"
        return _end(s, [ev.Log("info", msg), ev.Finish(s.step, s.rank, agreed=False)])
    if e.orphaned:
        return _end(s, [ev.Log("error", "coordinator lost: exiting"), ev.Exit(EXIT_ORPHANED)])
    if alone and e.stop:
        return _end(s, [ev.Log("info", f"stop requested by the coordinator at step {s.step}"), ev.Exit(0)])
    if alone and e.leave:
        return _end(s, [ev.Log("info", f"worker {s.worker} leaves at step {s.step} (SIGTERM)"), ev.Exit(0)])
    s, fx = _learn(s, e.announced)
    if alone and (late := _due(s.announced, s.honoured, s.step)):  # (learnt after its step: switch now)
        s = s._replace(honoured=s.honoured | set(late))
        if (option := late[-1].option) != s.option:
            return _switch(s, option, fx)
    if s.regime is Regime.GROUPS:
        return s._replace(phase=Phase.CATCH_UP), [*fx, ev.CatchUp()]
    if alone:
        return _run_unit(s, Proposal(), fx)
    due = _due(s.announced, s.honoured, _last(s) + 1)
    switch = e.switch or (due[-1].option if due else 0)  # (an announced switch rides the vote)
    return _run_unit(s, Proposal(pending_epoch=e.pending_epoch, stop=e.stop, switch=switch), fx)


def _learn(s: Machine, announced: tuple[SwitchAt, ...]) -> tuple[Machine, list[ev.Effect]]:
    new = [sw for sw in announced if sw not in s.announced]
    if not new:
        return s, []
    fx: list[ev.Effect] = [
        ev.Log("info", f"worker {s.worker}: switch to option {sw.option} announced for step {sw.step}")
        for sw in new
    ]
    return s._replace(announced=s.announced + tuple(new)), fx


def _due(announced: tuple[SwitchAt, ...], honoured: frozenset[SwitchAt], step: int) -> list[SwitchAt]:
    """Announced switches not taken yet, for steps up to ``step``."""
    return [sw for sw in announced if sw not in honoured and sw.step <= step]


def _last(s: Machine) -> int:
    """The last step of the unit that starts now."""
    return min(s.step + s.k, s.policy.total_steps) - 1


def _caught_up(s: Machine, e: ev.CaughtUp) -> Out:
    if e.view is None:
        return _out(s, "is out of the job")
    fx: list[ev.Effect] = []
    if e.view.epoch != s.epoch:
        s = _at(s, e.view)
        msg = f"worker {s.worker} adopted view {s.epoch} (rank {s.rank} of {s.world}) at step {s.step}"
        fx.append(ev.Log("info", msg))
    return _run_unit(s, Proposal(), fx)


def _run_unit(s: Machine, proposal: Proposal, fx: list[ev.Effect]) -> Out:
    last = _last(s)
    # (moves to a newer view on its own: without a barrier, and under groups per unit where the
    # strategy takes newcomers -- they join through a view the members move to)
    ask_pending = s.regime is Regime.ALONE or (s.regime is Regime.GROUPS and s.newcomers)
    unit = ev.RunUnit(s.step, last, s.epoch, s.rank, proposal, ask_pending=ask_pending)
    return s._replace(phase=Phase.UNIT, last=last), [*fx, unit]


def _unit_done(s: Machine, e: ev.UnitDone) -> Out:
    assert s.progress is not None
    d, vote = e.outcome, s.regime is Regime.VOTE
    pending = d.pending_epoch if vote else e.pending_now
    report = UnitReport(
        first_step=s.step, last_step=s.last, rank=s.rank, epoch=s.epoch, committed=d.committed,
        broken=d.broken, local_ok=d.local_ok, pending_epoch=pending, stop=d.stop, switch=d.switch,
        now_s=e.now_s, overflow=e.overflow,
    )  # fmt: skip
    b = decide(s.policy, s.progress, report)
    fx: list[ev.Effect] = []
    if d.broken:
        fx.append(ev.Log("warning", f"step {s.step} discarded: {d.reason}"))
        fx.append(ev.RecordDiscarded(s.step, s.epoch, d.reason))
    else:
        fx.append(ev.RecordUnit(flush=b.flush_records, digest=vote, strategy=s.name))
    at, honoured, plan_at = b.state.step, s.honoured, s.plan_at
    if b.action is Action.ADVANCE:  # (decide honoured the plan up to here; a vote, announcements)
        plan_at = at
        if vote and d.switch:  # (the announcements of the option the vote agreed)
            honoured = honoured | {sw for sw in s.announced if sw.step <= at and sw.option == d.switch}
    switch = b.switch_to
    if not vote and b.action is not Action.REDO and (due := _due(s.announced, honoured, at)):
        honoured = honoured | set(due)  # (no vote: each worker on its own)
        switch = switch or due[-1].option
    switch = switch if switch != s.option else 0
    s = s._replace(
        progress=b.state, step=at, ran_unit=True, plan_at=plan_at, honoured=honoured, in_boundary=True,
        then_switch=switch,
    )  # fmt: skip
    fx.append(ev.SetStep(at))
    if b.action is Action.ADVANCE:
        fx.append(ev.AfterCommit())
    if b.local_checkpoint:  # (first: rank 0's checkpoint then implies its local state)
        fx.append(ev.LocalCheckpoint(at, s.rank))
    if b.checkpoint:
        fx.append(ev.Checkpoint(at, agreed=vote))
    if b.evaluate:
        fx.append(ev.Evaluate(at))
    if b.stop in (StopReason.NONFINITE, StopReason.NONFINITE_LIMIT):
        what = e.nonfinite or "loss or gradient on another member"
        fx += [ev.FlushRecords(), ev.Nonfinite(at, what, own=bool(e.nonfinite))]
        return _end(s, [*fx, ev.Exit(EXIT_NONFINITE)])
    if b.stop is StopReason.REQUESTED:
        return _end(s, [*fx, ev.Log("info", f"stop requested by the coordinator at step {at}"), ev.Exit(0)])
    if b.recover:
        return s._replace(phase=Phase.RECOVER), [*fx, ev.CloseGroup(), ev.Recover(d.failed)]
    if b.change_view:
        s = s._replace(phase=Phase.MOVE, moving_to=b.change_view)
        return s, [*fx, ev.CloseGroup(), ev.MoveTo(b.change_view)]
    return _resume(s, fx)


# ---------------------------------------------------------------------- helpers
def _at(s: Machine, v: ev.ViewFacts) -> Machine:
    return s._replace(epoch=v.epoch, rank=v.rank, world=v.world_size)


def _end(s: Machine, fx: list[ev.Effect]) -> Out:
    return s._replace(phase=Phase.ENDED), fx


def _out(s: Machine, what: str) -> Out:
    return _end(s, [ev.Log("info", f"worker {s.worker} {what} at step {s.step}"), ev.Exit(0)])


_HANDLERS: dict[type, tuple[Phase, Callable[[Machine, Any], Out]]] = {
    ev.FirstView: (Phase.FIRST_VIEW, _first_view),
    ev.Restored: (Phase.RESTORE, _restored),
    ev.Built: (Phase.BUILD, _built),
    ev.Entered: (Phase.ENTER, _entered),
    ev.EnterFailed: (Phase.ENTER, _enter_failed),
    ev.ViewGiven: (Phase.RECOVER, _view_given),
    ev.Moved: (Phase.MOVE, _moved),
    ev.MoveFailed: (Phase.MOVE, _move_failed),
    ev.Polled: (Phase.POLL, _polled),
    ev.CaughtUp: (Phase.CATCH_UP, _caught_up),
    ev.UnitDone: (Phase.UNIT, _unit_done),
}
