"""The coordinator's membership state machine, driven through its handlers (no workers)."""

from __future__ import annotations

import pytest

from flotilla.comm.auth import generate_secret
from flotilla.comm.endpoint import Request
from flotilla.config import load_config
from flotilla.core.errors import RemoteError
from flotilla.roles.coordinator import Coordinator


@pytest.fixture
def coord():
    cfg = load_config("examples/tiny.yaml", ["cluster.num_workers=2"])
    c = Coordinator(cfg, generate_secret()).start()
    try:
        yield c
    finally:
        c.close()


def call(c: Coordinator, op: str, **body):
    fn, _schema = c._handlers()[op]
    return fn(Request(op=op, body=body, tensors=[], sender="test"))


def join(c: Coordinator, name: str) -> int:
    return call(c, "join", name=name, speed=None, pid=0)["worker_id"]


def poll(c: Coordinator, wid: int, after: int = 0, adopt: bool = False) -> dict:
    return call(c, "poll_view", worker_id=wid, after_epoch=after, adopt=adopt)


def renew(c: Coordinator, *wids: int) -> None:
    """Heartbeats as a worker's link sends them: the second echoes the first reply's lease stamp
    (a renewal, ``cluster/lease.py``; without one the coordinator adopts no view after the first)."""
    for w in wids:
        stamp = call(c, "heartbeat", worker_id=w, batch=-1, records=[], lease=None, ring=None)["lease_t"]
        call(c, "heartbeat", worker_id=w, batch=-1, records=[], lease=stamp, ring=None)


def test_first_view_forms_from_ready_workers_only(coord: Coordinator) -> None:
    a, b, c = join(coord, "w0"), join(coord, "w1"), join(coord, "late")
    assert poll(coord, a)["status"] == "wait"  # only one ready worker so far
    coord.remove_worker("w1", "died during set-up")  # joined, never ready
    assert poll(coord, c)["status"] == "view"  # a and c are ready: min_workers=2
    first = poll(coord, a)
    assert first["view"]["members"] == [a, c] and first["initial"] is True
    assert b not in first["view"]["members"]


def test_newcomer_enters_when_ready_and_is_not_initial(coord: Coordinator) -> None:
    a, b = join(coord, "w0"), join(coord, "w1")
    poll(coord, a), poll(coord, b)
    renew(coord, a, b)
    x = join(coord, "late")
    assert coord.snapshot()["latest_epoch"] == 1  # joining alone changes nothing
    assert poll(coord, x)["status"] == "wait"  # now ready: view 2 published, not adopted
    assert call(coord, "get_view", worker_id=a, epoch=2)["view"]["joined"] == [x]
    reply = poll(coord, x)
    assert reply["status"] == "view" and reply["initial"] is False


def test_recovery_without_membership_change_gets_a_fresh_epoch(coord: Coordinator) -> None:
    a, b = join(coord, "w0"), join(coord, "w1")
    poll(coord, a), poll(coord, b)
    renew(coord, a, b)
    # a collective timed out, nobody died: the first report waits for the other member
    assert poll(coord, a, after=1, adopt=True)["status"] == "wait"
    r2 = poll(coord, b, after=1, adopt=True)  # now every member of epoch 1 has reported
    assert r2["status"] == "view" and r2["view"]["epoch"] == 2 and r2["view"]["members"] == [a, b]
    r1 = poll(coord, a, after=1, adopt=True)  # the other survivor meets in the same epoch
    assert r1["view"]["epoch"] == 2 and r1["view"]["members"] == [a, b]


def test_failure_reported_before_the_death_notice_waits_for_it() -> None:
    """The bug of issue 11: survivors report the broken collective before the launcher's death
    notice; they must not be sent into a view that still holds the dead worker."""
    cfg = load_config("examples/tiny.yaml", ["cluster.num_workers=3"])
    c = Coordinator(cfg, generate_secret()).start()
    try:
        a, b, d = join(c, "w0"), join(c, "w1"), join(c, "w2")
        [poll(c, w) for w in (a, b, d)]
        renew(c, a, b, d)
        assert poll(c, a, after=1, adopt=True)["status"] == "wait"
        assert poll(c, b, after=1, adopt=True)["status"] == "wait"  # w2 neither reported nor dead
        with pytest.raises(RemoteError, match="view_broken"):  # a late vote is not let into epoch 1
            call(c, "get_view", worker_id=a, epoch=1)
        c.remove_worker("w2", "killed")
        ra, rb = poll(c, a, after=1, adopt=True), poll(c, b, after=1, adopt=True)
        assert ra["status"] == rb["status"] == "view"
        assert ra["view"] == rb["view"] and ra["view"]["members"] == [a, b] and ra["view"]["left"] == [d]
        states = {w["name"]: w["state"] for w in c.snapshot()["workers"]}
        assert states == {"w0": "ready", "w1": "ready", "w2": "dead"}
    finally:
        c.close()


def test_a_quiet_member_is_suspected_after_the_grace_and_may_come_back() -> None:
    cfg = load_config("examples/tiny.yaml", ["cluster.num_workers=2", "strategy.step_timeout_s=5"])
    now = [100.0]
    c = Coordinator(cfg, generate_secret(), now=lambda: now[0]).start()
    try:
        a, b = join(c, "w0"), join(c, "w1")
        poll(c, a), poll(c, b)
        renew(c, a, b)
        assert poll(c, a, after=1, adopt=True)["status"] == "wait"
        now[0] += 4.9  # b is alive (heartbeats) but hung: waited for one step timeout
        call(c, "heartbeat", worker_id=b, batch=1, records=[])
        assert poll(c, a, after=1, adopt=True)["status"] == "wait"
        now[0] += 0.2
        view = poll(c, a, after=1, adopt=True)["view"]
        assert view["members"] == [a] and view["left"] == [b] and view["epoch"] == 2
        assert poll(c, b, after=1, adopt=True)["status"] == "wait"  # b is ready again: view 3
        assert call(c, "get_view", worker_id=a, epoch=3)["view"]["joined"] == [b]
        assert poll(c, b, after=1, adopt=True)["view"]["members"] == [a, b]
    finally:
        c.close()


def test_crash_leave_and_stale_epochs(coord: Coordinator) -> None:
    a, b = join(coord, "w0"), join(coord, "w1")
    poll(coord, a), poll(coord, b)
    coord.remove_worker("w1", "exit code 9")
    assert poll(coord, b, after=1, adopt=True)["status"] == "removed"
    view = poll(coord, a, after=1, adopt=True)["view"]
    assert view["members"] == [a] and view["left"] == [b]
    # a vote that named an older epoch is redirected to the adopted one
    assert call(coord, "get_view", worker_id=a, epoch=1)["view"]["epoch"] == view["epoch"]
    with pytest.raises(RemoteError, match="unknown_epoch"):
        call(coord, "get_view", worker_id=a, epoch=99)


def test_heartbeat_batches_are_ingested_once(coord: Coordinator) -> None:
    a = join(coord, "w0")
    rec = {"time_s": 0.1, "step": 0, "loss": 1.0, "samples": 32, "epoch": 0, "membership_epoch": 1}
    for _ in range(3):  # the same batch re-sent after lost replies
        call(coord, "heartbeat", worker_id=a, batch=1, records=[rec])
    call(coord, "heartbeat", worker_id=a, batch=2, records=[dict(rec, step=1)])
    w = next(w for w in coord.snapshot()["workers"] if w["worker_id"] == a)
    assert w["samples"] == 64 and w["step"] == 1


def test_a_join_sent_again_with_its_token_is_the_same_admission(coord: Coordinator) -> None:
    """A worker whose join reply was lost sends the same join again: same worker, one member."""
    token = "ab" * 16
    first = call(coord, "join", name="w0", speed=None, pid=7, join_token=token)
    again = call(coord, "join", name="w0", speed=None, pid=7, join_token=token)
    assert again == first
    other = call(coord, "join", name="w1", speed=None, pid=8, join_token="cd" * 16)
    assert other["worker_id"] != first["worker_id"]
    assert sorted(w["name"] for w in coord.snapshot()["workers"]) == ["w0", "w1"]
    coord.remove_worker("w1", "died during set-up")  # declared dead: its token admits anew
    again_w1 = call(coord, "join", name="w1", speed=None, pid=8, join_token="cd" * 16)
    assert again_w1["worker_id"] not in (first["worker_id"], other["worker_id"])
    for bad in ("xyz", "ab" * 40, ""):
        with pytest.raises(RemoteError, match="join_token must be 16 to 64 hex digits"):
            call(coord, "join", name="w2", speed=None, pid=9, join_token=bad)
    assert len(coord.snapshot()["workers"]) == 3  # (a refused join changes nothing)


def test_bad_speed_is_refused(coord: Coordinator) -> None:
    with pytest.raises(RemoteError, match="bad_speed"):
        call(coord, "join", name="x", speed=2.5, pid=0)
    assert coord.snapshot()["workers"] == []


@pytest.fixture
def ps_coord():
    cfg = load_config(
        "examples/tiny.yaml", ["cluster.num_workers=2", "strategy={kind: ps, consistency: ssp, staleness: 1}"]
    )
    c = Coordinator(cfg, generate_secret()).start()
    try:
        yield c
    finally:
        c.close()


def _rec(t: float, clock: int) -> dict:
    return {
        "time_s": t,
        "step": clock,
        "clock": clock,
        "loss": 1.0,
        "samples": 8,
        "step_s": 0.5,
        "epoch": 0,
        "membership_epoch": 1,
    }


def test_ps_clock_spread_compares_clocks_at_the_same_instant(ps_coord: Coordinator) -> None:
    """w1's heartbeat lags: its latest report is 6 clocks behind w0's, but at every instant the
    two were at most 1 clock apart; the snapshot shows the latter, and the summary fields."""
    a, b = join(ps_coord, "w0"), join(ps_coord, "w1")
    call(ps_coord, "heartbeat", worker_id=a, batch=1, records=[_rec(i, i) for i in range(8)])
    call(ps_coord, "heartbeat", worker_id=b, batch=1, records=[_rec(0.5, 0), _rec(1.5, 1)])
    snap = ps_coord.snapshot()
    clocks = {w["name"]: w["clock"] for w in snap["workers"]}
    assert clocks == {"w0": 7, "w1": 1}  # what the old display subtracted: 6
    # at t=1.5 (w1's latest report) both are at clock 1; at t=1.0 w0 was at 1 and w1 at 0
    assert snap["clock_spread"] == 0 and snap["max_clock_spread"] == 1
    call(ps_coord, "heartbeat", worker_id=b, batch=2, records=[_rec(i + 0.5, i) for i in range(2, 8)])
    # a malformed record is dropped whole: neither the spread nor the worker's counters change
    call(ps_coord, "heartbeat", worker_id=b, batch=3, records=[dict(_rec(9.0, 0), clock="x")])
    call(ps_coord, "heartbeat", worker_id=b, batch=4, records=[dict(_rec(9.5, 99), loss="bad")])
    call(ps_coord, "finish", result={"test_accuracy": 1.0})
    assert ps_coord.snapshot()["clock_spread"] == 1  # w0's last records wait for w1's exit
    ps_coord.mark_left("w0"), ps_coord.mark_left("w1")  # the launcher saw both processes exit
    snap = ps_coord.snapshot()
    assert snap["clock_spread"] == 0 and snap["max_clock_spread"] == 1
    w1 = next(w for w in snap["workers"] if w["name"] == "w1")
    assert w1["clock"] == 7 and w1["samples"] == 8 * 8 and w1["busy_s"] == 0.5 * 8


def test_no_clock_spread_outside_strategy_ps(coord: Coordinator) -> None:
    a = join(coord, "w0")
    call(coord, "heartbeat", worker_id=a, batch=1, records=[_rec(0.0, 0)])
    snap = coord.snapshot()
    assert snap["clock_spread"] is None and snap["max_clock_spread"] is None
