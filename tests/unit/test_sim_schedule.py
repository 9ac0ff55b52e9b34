"""The config's revocation events in the simulator (``sim/schedule.py``): timed ones at their
second, step-anchored ones when *this strategy's* simulated job reaches the step (resolved one
anchor at a time: exact), stops and unreached anchors named in the note; and end to end through
``flotilla simulate``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flotilla.cli.main import app
from flotilla.cluster.revocations import Action, RevocationAction
from flotilla.sim.model import Change, DeviceClass, Recovery, SimCluster, SimJob
from flotilla.sim.schedule import schedule_changes, step_reached_at
from flotilla.sim.vote import VoteSpec

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = SimCluster(classes=(DeviceClass(type="a", count=4, per_node=4),))
JOB = SimJob(steps=100, step_s=0.1, model_bytes=1000)
RECOVERY = Recovery(detect_s=0.5, repair_s=0.1, startup_s=2.0)
NAMES = {"w0": "a-0", "w1": "a-1", "w2": "a-2", "w3": "a-3"}


def run(changes: list[Change]):
    return VoteSpec().simulate(JOB, CLUSTER, changes=changes, recovery=RECOVERY)


def act(action: Action, worker: str, **kw) -> RevocationAction:
    return RevocationAction(action=action, worker=worker, **kw)


def test_timed_events_are_changes_at_their_second_and_stops_are_named() -> None:
    plan = [
        act(Action.KILL, "w1", at_s=2.0),
        act(Action.STOP, "w2", at_s=3.0, duration_s=1.0),
        act(Action.STOP, "w3", at_s=3.5, duration_s=0.4),  # (shorter than it takes to put it out)
        act(Action.ADD, "w1", at_s=4.0),
        act(Action.ADD, "w9", at_s=5.0),
    ]
    changes, note = schedule_changes(plan, NAMES, run, recovery=Recovery(detect_s=0.2))
    # the stopped worker is out 0.5 s after its stop (peer heartbeat 0.25 s: its watchers'
    # suspicion within 2 intervals, confirmed by 0.5 s of silence at the coordinator): the
    # revocation is 0.5 - detect_s after the stop; it is back when it wakes, ready two intervals later
    assert changes == [
        Change(2.0, True, "a-1"),
        Change(3.3, True, "a-2", cause_s=3.0),
        Change(4.0, False, "a-1"),
        Change(4.0, False, "a-2", ready_s=0.5, cause_s=3.0),
        Change(5.0, False, "w9"),
    ]
    assert note.startswith("1 stop(s) of at most 0.5 s not simulated (a stall")
    # a slower heartbeat (1 s): out 2 s after the stop, ready 2 s after waking; 1 s is short now
    slow, note = schedule_changes(
        [act(Action.STOP, "w2", at_s=3.0, duration_s=5.0), act(Action.STOP, "w3", at_s=3.0, duration_s=1.0)],
        NAMES, run, recovery=Recovery(detect_s=0.2), peer_heartbeat_s=1.0,
    )  # fmt: skip
    assert slow == [
        Change(3.0 + 2.0 - 0.2, True, "a-2", cause_s=3.0),
        Change(8.0, False, "a-2", ready_s=2.0, cause_s=3.0),
    ]
    assert note.startswith("1 stop(s) of at most 2 s not simulated")


def test_a_worker_killed_while_stopped_does_not_come_back() -> None:
    plan = [act(Action.STOP, "w2", at_s=1.0, duration_s=3.0), act(Action.KILL, "w2", at_s=2.0)]
    changes, _ = schedule_changes(plan, NAMES, run, recovery=Recovery(detect_s=0.2))
    assert changes == [Change(1.3, True, "a-2", cause_s=1.0), Change(2.0, True, "a-2")]


def test_a_stopped_worker_leaves_the_views_and_comes_back_as_a_newcomer() -> None:
    """The simulated job goes on without a worker stopped for 3 s and takes it back once it is
    ready after waking (not a process start-up later: ``Recovery.startup_s`` is 2 s here)."""
    changes, _ = schedule_changes([act(Action.STOP, "w2", at_s=1.0, duration_s=3.0)], NAMES, run)
    result = run(changes)
    assert result.completed and len(result.recoveries_s) == 1
    # its recovery counts from the stop (as the runtime's report does): out after 0.5 s at least
    assert result.recoveries_s[0] >= 0.5
    live = [(t, n) for t, _done, n in result.timeline]
    assert any(n == 3 for t, n in live if 1.5 < t < 4.0)
    back = min(t for t, n in live if n == 4 and t > 4.0)
    assert 4.5 <= back < 4.0 + RECOVERY.startup_s  # (ready 0.5 s after waking, then the next unit)


def test_a_step_anchored_kill_happens_when_this_strategys_job_reaches_the_step() -> None:
    plain = run([])
    changes, note = schedule_changes([act(Action.KILL, "w3", at_step=40)], NAMES, run)
    at = math.nextafter(step_reached_at(plain, 40), math.inf)  # (just after the unit that reached it)
    assert note == "" and changes == [Change(at, True, "a-3")]
    assert changes[0].at_s == pytest.approx(40 * plain.time_s / 100)  # (an even all-reduce: steps alike)
    killed = run(changes)
    assert killed.completed and len(killed.recoveries_s) == 1
    # DiLoCo reaches step 40 at another instant: the same event, another change
    diloco = VoteSpec(name="diloco", inner_steps=10)

    def run_diloco(ch: list[Change]):
        return diloco.simulate(JOB, CLUSTER, changes=ch, recovery=RECOVERY)

    (theirs,), _ = schedule_changes([act(Action.KILL, "w3", at_step=40)], NAMES, run_diloco)
    assert theirs.at_s == math.nextafter(step_reached_at(run_diloco([]), 40), math.inf) != changes[0].at_s


def test_a_second_anchor_is_resolved_on_the_run_that_holds_the_first() -> None:
    """Exact, not estimated from the run without revocations: after the kill at step 30 the job
    is slower (a recovery), so it reaches step 60 later than the plain run did."""
    plan = [act(Action.KILL, "w3", at_step=30), act(Action.KILL, "w2", at_step=60)]
    changes, _ = schedule_changes(plan, NAMES, run)
    first, second = changes
    assert second.at_s == math.nextafter(step_reached_at(run([first]), 60), math.inf)
    assert second.at_s > step_reached_at(run([]), 60)
    # and the simulation with both reached step 60 exactly when the second kill came
    assert step_reached_at(run(changes), 60) == pytest.approx(second.at_s)


def test_a_clock_started_at_a_step_and_an_anchor_never_reached() -> None:
    plain = run([])
    plan = [
        act(Action.KILL, "w1", at_s=1.5, from_step=20),  # (``time_from_step: 20``)
        act(Action.ADD, "w1", at_step=500),  # (after the job's 100 steps)
    ]
    changes, note = schedule_changes(plan, NAMES, run)
    assert changes == [Change(math.nextafter(step_reached_at(plain, 20), math.inf) + 1.5, True, "a-1")]
    assert note == "1 step-anchored event(s) after the job's end dropped"


def test_flotilla_simulate_replays_the_configs_events() -> None:
    events = "{events: [{at_step: 20, action: kill, worker: w1}, "
    events += "{at_s: 1.0, action: stop, worker: w2, duration_s: 1}, "
    events += "{at_s: 1.5, action: stop, worker: w3, duration_s: 0.2}]}"
    args = ["simulate", str(ROOT / "examples" / "demo.yaml"), "--strategies", "allreduce,adpsgd"]
    args += ["--step-s", "0.01", "--set", f"cluster.revocations={events}"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "3 revocation event(s) of cluster.revocations" in result.output
    rows = [line for line in result.output.splitlines() if line.startswith(("allreduce", "adpsgd"))]
    assert len(rows) == 2 and all("1 stop(s) of at most 0.5 s not simulated" in r for r in rows), rows
    assert " 2 recoveries" in rows[0], rows[0]  # (all-reduce: the kill and the long stop broke a unit)


def test_a_traces_clock_starts_at_time_from_step_too() -> None:
    """The runtime's plan starts every timed action's clock at ``time_from_step`` -- a trace's
    too: the given (trace) changes move to the instant the job reached that step."""
    plain = run([])
    trace = [Change(1.0, True, "a-2"), Change(3.0, False, "a-2")]
    changes, _ = schedule_changes([], NAMES, run, given=trace, given_from_step=25)
    start = math.nextafter(step_reached_at(plain, 25), math.inf)
    assert changes == [Change(start + 1.0, True, "a-2"), Change(start + 3.0, False, "a-2")]
    assert schedule_changes([], NAMES, run, given=trace)[0] == trace  # (no such step: from the start)
