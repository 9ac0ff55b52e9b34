"""The partial-reduce controller's runtime (``sync/pr_service.py``) at the end of a job: a
worker whose partners *finished* (``pr_leave``) is told ``done`` (its training is over, it keeps its
last average) instead of training on alone; a survivor of *deaths* (``on_dead``) gets ``solo``."""

from __future__ import annotations

from flotilla.sync.pr_plan import ControllerConfig
from flotilla.sync.pr_service import PRController


def _ready(ctrl: PRController, wid: int, seq: int) -> str:
    return ctrl.handle("pr_ready", {"worker_id": wid, "seq": seq, "version": seq})["status"]


def test_partners_finished_means_done_partners_dead_means_solo() -> None:
    finished = PRController(ControllerConfig(group_size=2), 3, now=lambda: 0.0)
    assert _ready(finished, 0, 1) == "wait"  # (builds the controller: 0 waits for a partner)
    for wid in (1, 2):
        assert finished.handle("pr_leave", {"worker_id": wid, "finished": True}) == {"ok": True}
    assert _ready(finished, 0, 1) == "done"  # (the same seq: a poll)
    dead = PRController(ControllerConfig(group_size=2), 3, now=lambda: 0.0)
    assert _ready(dead, 0, 1) == "wait"
    for wid in (1, 2):
        dead.on_dead(wid)
    assert _ready(dead, 0, 1) == "solo"
    assert _ready(dead, 0, 2) == "solo"


def test_partners_that_left_mid_run_leave_it_training_solo() -> None:
    """A partner that closed its strategy before its last step (a switch to another strategy, a
    leave) is not *finished*: a lagging worker trains on (solo) to its own switch step."""
    left = PRController(ControllerConfig(group_size=2), 3, now=lambda: 0.0)
    assert _ready(left, 0, 1) == "wait"
    for wid in (1, 2):
        assert left.handle("pr_leave", {"worker_id": wid, "finished": False}) == {"ok": True}
    assert _ready(left, 0, 1) == "solo"
