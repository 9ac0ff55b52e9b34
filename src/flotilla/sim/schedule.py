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
- a **stop** (SIGSTOP for ``duration_s``) is not simulated (the simulator has no frozen worker:
  counted in the note); an anchor the job never reaches is dropped (counted too);
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

import math
from collections.abc import Callable, Mapping, Sequence

from flotilla.cluster.revocations import Action, RevocationAction
from flotilla.sim.model import Change, SimResult

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


def _change(action: RevocationAction, at_s: float, names: Mapping[str, str]) -> Change:
    return Change(at_s, action.action is Action.KILL, names.get(action.worker, action.worker))


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
) -> tuple[list[Change], str]:
    """``plan``'s changes for the strategy ``simulate`` runs (see the module doc), merged with the
    ``given`` ones (a trace's: with ``given_from_step`` -- the schedule's ``time_from_step`` --
    their clock starts when the job reached that step, as the runtime's trace actions' does),
    sorted by time; and a note of what was left out ("" if nothing)."""
    stops = sum(1 for a in plan if a.action is Action.STOP)
    acting = [a for a in plan if a.action is not Action.STOP]
    changes = [_change(a, float(a.at_s or 0.0), names) for a in acting if _anchor(a) is None]
    anchored: dict[int, list[RevocationAction | Change]] = {}
    if given_from_step is None:
        changes += list(given)
    elif given:
        anchored[given_from_step] = list(given)
    for a in acting:
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
        result = simulate(sorted(changes, key=_order))
        at = step_reached_at(result, step)
        if at is None:  # (never reached: neither is any later anchor)
            dropped += sum(len(anchored[s]) for s in sorted(anchored)[i:])
            break
        after = math.nextafter(at, math.inf)  # (the unit that reached the step is done)
        for item in anchored[step]:
            if isinstance(item, Change):  # (a given change, its clock started at the step)
                changes.append(Change(after + item.at_s, item.kill, item.name))
                continue
            offset = float(item.at_s) if item.at_step is None and item.at_s is not None else 0.0
            changes.append(_change(item, after + offset, names))
    notes = []
    if stops:
        notes.append(f"{stops} stop(s) not simulated (no frozen workers in the simulator)")
    if dropped:
        notes.append(f"{dropped} step-anchored event(s) after the job's end dropped")
    return sorted(changes, key=_order), "; ".join(notes)


def _order(c: Change) -> tuple[float, int, str]:
    return (c.at_s, 0 if c.kill else 1, c.name)  # (kills first at equal times, as the plan orders them)
