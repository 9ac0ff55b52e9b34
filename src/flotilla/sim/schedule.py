"""A revocation plan (``cluster/revocations.plan_revocations``: the runtime's own planner, from the
config's ``cluster.revocations`` events and random rate) as the simulator's device changes
(pure; no torch, no I/O, no clock).

- a **timed** action (``at_s``) is a change at that simulated second: ``kill`` (with or without
  ``notice_s``: the worker is gone from ``at_s``; under a notice it leaves at its next boundary,
  which the simulator counts as the instant itself) revokes the device, ``add`` brings it (back)
  or a new one of the first class (``SimCluster.spare``), ready ``Recovery.startup_s`` later;
- an action **anchored to a step** -- ``at_step``, or a timed one whose clock starts at
  ``from_step`` (``time_from_step``) -- happens when *this strategy's* simulated job reaches that
  step, which only a simulation knows.  The anchors are resolved in step order: simulate with the
  changes known so far, read the instant the step was reached from the result's timeline (the
  end of the unit that completed it), add the anchored changes just after it (the next float:
  the unit that reached the step has committed, as the runtime fires an ``at_step`` event at the
  start of that step; plus their ``at_s``), and simulate again for the next anchor.  Exact, not
  an estimate: what a simulation does before an instant does not depend on changes after it
  (each simulation is deterministic);
- a **stop** (SIGSTOP for ``duration_s``) is what the runtime makes of it (``docs/membership.md``):
  a worker stopped for longer than it takes to put it out of the views
  (``PeerWatchPolicy.frozen_out_s``: its watchers' suspicion, confirmed by the coordinator's
  silence) is revoked then -- the change comes ``frozen_out_s - Recovery.detect_s`` after the
  stop, so the survivors act on it ``frozen_out_s`` after it, and its recovery counts from the
  stop (``Change.cause_s``), as the runtime's report does -- and arrives again when it wakes,
  ready to join two peer-heartbeat intervals later (it learns it is out and starts a fresh
  session: SPEC §7's bound; no process start-up: ``Change.ready_s``).  A shorter stop is a stall
  the simulator does not model (counted in the note), as is what a stopped worker's peers do
  before it is out (they wait in the simulation's collectives as in the runtime's, but the
  simulated device keeps computing until its revocation);
- an anchor the job never reaches is dropped (counted in the note);
- a spot trace's changes (replayed apart, onto groups of devices) start their clock at the
  schedule's ``time_from_step`` too, as the runtime's trace actions do.

"Reaching a step" is each simulation's timeline: the most advanced worker's steps under partial
reduce and AD-PSGD (as the runtime's revocation driver counts them), the agreed step under a vote,
but the *slowest* worker's clock (``c_global``) under a parameter server, where the runtime counts
the fastest worker's: under SSP/ASP with a straggler an anchored event comes up to the staleness
bound later in the simulation than in a run.

``names`` maps the config's worker names to the simulated devices' (``cli/simulate_inputs``: the
cluster's classes keep the workers' order); a worker it does not know is a new device of that
name (an ``add`` of a new worker).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

from flotilla.cluster.peer_watch import PeerWatchPolicy
from flotilla.cluster.revocations import Action, RevocationAction
from flotilla.sim.model import Change, Recovery, SimResult

__all__ = ["MAX_ANCHORS", "schedule_changes", "step_reached_at"]

MAX_ANCHORS = 1_000  # distinct anchor steps resolved (each costs one simulation)


def step_reached_at(result: SimResult, step: int) -> float | None:
    """The simulated instant ``result``'s job had done ``step`` steps (0: the start), or None if
    it never did."""
    if step <= 0:
        return 0.0
    for t, done, _live in result.timeline:
        if done >= step:
            return t
    return None


def _changes(
    action: RevocationAction,
    at_s: float,
    names: Mapping[str, str],
    recovery: Recovery,
    watch: PeerWatchPolicy,
) -> list[Change]:
    """The changes of ``action`` happening at ``at_s`` (a stop: its revocation and its return, or
    none when it is too short to put the worker out: see the module doc)."""
    name = names.get(action.worker, action.worker)
    if action.action is not Action.STOP:
        return [Change(at_s, action.action is Action.KILL, name)]
    duration = float(action.duration_s or 0.0)
    out_s = watch.frozen_out_s
    if duration <= out_s:
        return []
    revoked = at_s + max(0.0, out_s - recovery.detect_s)
    return [
        Change(revoked, True, name, cause_s=at_s),
        Change(at_s + duration, False, name, ready_s=2 * watch.interval_s, cause_s=at_s),
    ]


def _woken(changes: list[Change]) -> list[Change]:
    """``changes`` less the return of a stopped worker that was killed while it was stopped (a
    return carries its stop's instant as ``cause_s``): a dead process does not wake."""
    killed = [c for c in changes if c.kill and c.cause_s is None]
    return [
        c
        for c in changes
        if c.kill
        or c.cause_s is None
        or not any(k.name == c.name and c.cause_s <= k.at_s <= c.at_s for k in killed)
    ]


def _anchor(action: RevocationAction) -> int | None:
    """The step an action waits for (None: a plain timed action)."""
    if action.at_step is not None:
        return action.at_step
    return action.from_step


def schedule_changes(
    plan: Sequence[RevocationAction],
    names: Mapping[str, str],
    simulate: Callable[[list[Change]], SimResult],
    *,
    given: Sequence[Change] = (),
    given_from_step: int | None = None,
    recovery: Recovery = Recovery(),
    peer_heartbeat_s: float = 0.25,
) -> tuple[list[Change], str]:
    """``plan``'s changes for the strategy ``simulate`` runs (see the module doc), merged with the
    ``given`` ones (a trace's: with ``given_from_step`` -- the schedule's ``time_from_step`` --
    their clock starts when the job reached that step, as the runtime's trace actions' does),
    sorted by time; and a note of what was left out ("" if nothing).  ``recovery``: the costs
    the simulation runs with; ``peer_heartbeat_s``: the cluster's (how soon a stopped worker is
    out, and back)."""
    watch = PeerWatchPolicy(interval_s=peer_heartbeat_s)
    short = sum(1 for a in plan if a.action is Action.STOP and float(a.duration_s or 0) <= watch.frozen_out_s)
    changes: list[Change] = []
    for a in plan:
        if _anchor(a) is None:
            changes += _changes(a, float(a.at_s or 0.0), names, recovery, watch)
    anchored: dict[int, list[RevocationAction | Change]] = {}
    if given_from_step is None:
        changes += list(given)
    elif given:
        anchored[given_from_step] = list(given)
    for a in plan:
        step = _anchor(a)
        if step is not None:
            anchored.setdefault(step, []).append(a)
    if len(anchored) > MAX_ANCHORS:
        raise ValueError(
            f"cluster.revocations: {len(anchored)} distinct steps anchor events; the simulator "
            f"resolves at most {MAX_ANCHORS} (each needs one simulation)"
        )
    dropped = 0
    for i, step in enumerate(sorted(anchored)):
        result = simulate(sorted(_woken(changes), key=_order))
        at = step_reached_at(result, step)
        if at is None:  # (never reached: neither is any later anchor)
            dropped += sum(len(anchored[s]) for s in sorted(anchored)[i:])
            break
        after = math.nextafter(at, math.inf)  # (the unit that reached the step is done)
        for item in anchored[step]:
            if isinstance(item, Change):  # (a given change, its clock started at the step)
                shifted = None if item.cause_s is None else after + item.cause_s
                changes.append(dataclasses.replace(item, at_s=after + item.at_s, cause_s=shifted))
                continue
            offset = float(item.at_s) if item.at_step is None and item.at_s is not None else 0.0
            changes += _changes(item, after + offset, names, recovery, watch)
    notes = []
    if short:
        notes.append(
            f"{short} stop(s) of at most {watch.frozen_out_s:g} s not simulated (a stall: the worker "
            "is not put out of the views)"
        )
    if dropped:
        notes.append(f"{dropped} step-anchored event(s) after the job's end dropped")
    return sorted(_woken(changes), key=_order), "; ".join(notes)


def _order(c: Change) -> tuple[float, int, str]:
    return (c.at_s, 0 if c.kill else 1, c.name)  # (kills first at equal times, as the plan orders them)
