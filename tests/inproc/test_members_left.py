"""The coordinator names every member the job went on without, and how it went (issue 18, honest
endings): a worker that asked to leave or exited by itself before the job was done is in the
snapshot's (and so the summary's) ``members_left`` with when and why, a dead one in
``members_lost``; leaving once the job is done is the normal end, not listed."""

from __future__ import annotations

from flotilla.cluster import rendezvous_events as ev
from flotilla.comm.auth import generate_secret
from flotilla.comm.endpoint import Request
from flotilla.config import load_config
from flotilla.report.summary import run_summary
from flotilla.roles.coordinator import Coordinator
from flotilla.roles.members_lost import LostMembers


def _call(c: Coordinator, op: str, **body):
    fn, _schema = c._handlers()[op]
    return fn(Request(op=op, body=body, tensors=[], sender="test"))


def _training(c: Coordinator, *names: str) -> dict[str, int]:
    """Workers ``names`` join, adopt the first view and report a trained step (state: training)."""
    ids = {n: _call(c, "join", name=n, speed=None, pid=0)["worker_id"] for n in names}
    rec = {"time_s": 0.1, "step": 0, "loss": 1.0, "samples": 4, "epoch": 0, "membership_epoch": 1}
    for wid in ids.values():
        _call(c, "poll_view", worker_id=wid, after_epoch=0, adopt=True)
        _call(c, "heartbeat", worker_id=wid, batch=1, records=[rec])
    return ids


def test_left_and_lost_members_are_named_with_when_and_why() -> None:
    cfg = load_config("examples/tiny.yaml", ["cluster.num_workers=4"])
    coord = Coordinator(cfg, generate_secret()).start()
    try:
        ids = {
            n: _call(coord, "join", name=n, speed=None, pid=0)["worker_id"] for n in ("w0", "w1", "w2", "w3")
        }
        for wid in ids.values():
            _call(coord, "poll_view", worker_id=wid, after_epoch=0, adopt=False)
        _call(coord, "leave", worker_id=ids["w1"])  # SIGTERM: asked to leave
        coord.mark_left("w2")  # its process exited 0 before the job was done
        coord.remove_worker("w3", "process exited with code -9")
        snap = coord.snapshot()
    finally:
        coord.close()
    left = {m["name"]: m for m in snap["members_left"]}
    assert set(left) == {"w1", "w2"}
    assert left["w1"]["why"] == "it asked to leave (SIGTERM)" and left["w1"]["at_s"] >= 0
    assert left["w2"]["why"] == "its process exited (code 0)"
    assert [m["name"] for m in snap["members_lost"]] == ["w3"]
    assert "exited with code -9" in snap["members_lost"][0]["why"]
    summary = run_summary(snap, strategy="allreduce")
    assert [m["name"] for m in summary["members_left"]] == ["w1", "w2"]
    assert summary["degraded"] == "lost 1 of 4 workers (w3): see members_lost"


def test_leaving_once_the_job_is_done_is_not_listed() -> None:
    cfg = load_config("examples/tiny.yaml", ["cluster.num_workers=2"])
    coord = Coordinator(cfg, generate_secret()).start()
    try:
        ids = [_call(coord, "join", name=n, speed=None, pid=0)["worker_id"] for n in ("w0", "w1")]
        for wid in ids:
            _call(coord, "poll_view", worker_id=wid, after_epoch=0, adopt=False)
        _call(coord, "finish", worker_id=ids[0], result={"steps": 1})
        _call(coord, "leave", worker_id=ids[1])
        coord.mark_left("w0")
        snap = coord.snapshot()
    finally:
        coord.close()
    assert snap["done"] and snap["members_left"] == [] and snap["members_lost"] == []


def test_a_rank_that_trained_its_last_step_before_rank_0_reported_is_done_not_left() -> None:
    """The end of a normal run: the ranks other than 0 finish (``leave`` with ``finished``) and
    their processes exit 0 while rank 0 still evaluates and exports; they are done, not listed
    among the workers that left mid-job (the demo's summary once said "left")."""
    cfg = load_config("examples/tiny.yaml", ["cluster.num_workers=3"])
    coord = Coordinator(cfg, generate_secret()).start()
    try:
        ids = {n: _call(coord, "join", name=n, speed=None, pid=0)["worker_id"] for n in ("w0", "w1", "w2")}
        for wid in ids.values():
            _call(coord, "poll_view", worker_id=wid, after_epoch=0, adopt=False)
        rec = {"time_s": 0.1, "step": 0, "loss": 1.0, "samples": 32, "epoch": 0, "membership_epoch": 1}
        for n, wid in ids.items():
            _call(coord, "heartbeat", worker_id=wid, batch=1, records=[dict(rec, name=n)])
        _call(coord, "leave", worker_id=ids["w1"], finished=True)
        coord.mark_left("w1")  # its process exited 0 (after saying it finished)
        _call(coord, "leave", worker_id=ids["w2"])  # a SIGTERM leave is still a leave
        mid = coord.snapshot()
        _call(coord, "finish", worker_id=ids["w0"], result={"steps": 1})
        coord.mark_left("w0")
        snap = coord.snapshot()
    finally:
        coord.close()
    states = {w["name"]: w["state"] for w in mid["workers"]}
    assert states == {"w0": "training", "w1": "done", "w2": "left"}, states
    assert [m["name"] for m in snap["members_left"]] == ["w2"]
    assert {w["name"]: w["state"] for w in snap["workers"]} == {"w0": "done", "w1": "done", "w2": "left"}
    summary = run_summary(snap, strategy="allreduce")
    assert [m["name"] for m in summary["members_left"]] == ["w2"] and summary["members_lost"] == []


def test_a_crash_the_launcher_reaps_after_the_jobs_end_is_still_a_lost_member() -> None:
    # (a short job: the others finish -- and the job's end makes every worker still training
    # done -- before the launcher reaps the process that crashed at step 1)
    cfg = load_config("examples/tiny.yaml", ["cluster.num_workers=3"])
    coord = Coordinator(cfg, generate_secret()).start()
    try:
        ids = _training(coord, "w0", "w1", "w2")
        assert {w["state"] for w in coord.snapshot()["workers"]} == {"training"}
        _call(coord, "leave", worker_id=ids["w1"], finished=True)
        _call(coord, "finish", worker_id=ids["w0"], result={"steps": 20})
        assert {w["name"]: w["state"] for w in coord.snapshot()["workers"]}["w2"] == "done"  # (the end's)
        coord.remove_worker("w2", "process exited with code 1: IndexError: list index out of range")
        snap = coord.snapshot()
    finally:
        coord.close()
    assert snap["done"]
    (lost,) = snap["members_lost"]
    assert lost["name"] == "w2" and "IndexError" in lost["why"], lost
    states = {w["name"]: w["state"] for w in snap["workers"]}
    assert states == {"w0": "done", "w1": "done", "w2": "dead"}
    summary = run_summary(snap, strategy="partial_reduce")
    assert summary["num_workers"] == 2
    assert summary["degraded"] == "lost 1 of 3 workers (w2): see members_lost"


def test_a_worker_that_finished_then_exited_with_an_error_is_not_lost() -> None:
    cfg = load_config("examples/tiny.yaml", ["cluster.num_workers=2"])
    coord = Coordinator(cfg, generate_secret()).start()
    try:
        ids = _training(coord, "w0", "w1")
        _call(coord, "leave", worker_id=ids["w1"], finished=True)
        _call(coord, "finish", worker_id=ids["w0"], result={"steps": 1})
        coord.remove_worker("w1", "process exited with code 1")
        snap = coord.snapshot()
    finally:
        coord.close()
    assert snap["members_lost"] == [] and {w["state"] for w in snap["workers"]} == {"done"}


def test_the_process_end_names_the_cause_of_a_member_its_neighbours_found_silent_first() -> None:
    lost = LostMembers(t0_unix=0.0, heartbeat_timeout_s=10.0)
    seen = ev.Suspected(0, (2,), 0.5, 1.0, closed=False)
    assert lost.note(2, "w2", seen, suspected=False)
    assert "neighbour watch" in lost.to_list()[0]["why"]
    lost.notice(2, "process exited with code 1: ValueError: bad sample")
    (m,) = lost.to_list()
    assert m["why"].startswith("its process ended (process exited with code 1: ValueError: bad sample)")
    assert "neighbour watch" in m["why"]  # (what was seen first is kept after it)
    lost.notice(2, "process exited with code 1: ValueError: bad sample")  # (once)
    assert lost.to_list()[0]["why"] == m["why"]
