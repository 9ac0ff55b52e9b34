"""The partial-reduce controller's runtime (``sync/pr_service.py``) admitting a newcomer: a worker
that joined the running job asks as ``fresh``; it is admitted only when the coordinator counts it
live and the controller never had it; its first group gives it weight 0 and the step its holders
reached; with no holder left it is told ``lost``."""

from __future__ import annotations

import pytest

from flotilla.core.errors import RemoteError
from flotilla.sync.pr_plan import ControllerConfig
from flotilla.sync.pr_service import PRController


def _ready(ctrl: PRController, wid: int, seq: int, **extra: object) -> dict:
    return ctrl.handle(
        "pr_ready", {"worker_id": wid, "seq": seq, "version": extra.pop("version", seq), **extra}
    )


def test_a_newcomer_counted_live_is_filled_by_a_holder_and_starts_at_its_step() -> None:
    live = [0, 1, 2]
    ctrl = PRController(ControllerConfig(group_size=2), 3, now=lambda: 0.0, live=lambda: tuple(live))
    assert _ready(ctrl, 0, 1, step=40)["status"] == "wait"  # (builds the controller from 0, 1, 2)
    with pytest.raises(RemoteError, match="not a live member"):
        _ready(ctrl, 3, 1, version=0, fresh=True)  # not counted live by the coordinator: refused
    live.append(3)
    a = _ready(ctrl, 3, 1, version=0, fresh=True)
    assert a["status"] == "group" and a["members"] == [0, 3] and a["weights"] == [1.0, 0.0]
    assert a["step"] == 40  # the steps the holder had done
    for wid in (0, 3):
        ctrl.handle("pr_done", {"worker_id": wid, "group_id": a["group_id"], "ok": True})
    assert (
        ctrl.handle("pr_done", {"worker_id": 3, "group_id": a["group_id"], "ok": True})["status"]
        == "committed"
    )
    assert _ready(ctrl, 3, 1, version=0, fresh=True)["status"] == "group"  # (a poll: the same answer)
    assert _ready(ctrl, 3, 2, version=1, step=41)["status"] == "wait"  # an ordinary member now
    assert ctrl.stats()["groups"] == 1


def test_a_newcomer_with_no_holder_left_is_told_the_model_is_lost() -> None:
    live = [0, 1]
    ctrl = PRController(ControllerConfig(group_size=2), 2, now=lambda: 0.0, live=lambda: tuple(live))
    assert _ready(ctrl, 0, 1)["status"] == "wait"
    live.append(5)
    assert _ready(ctrl, 5, 1, version=0, fresh=True)["status"] in ("group", "wait")
    ctrl.on_dead(0)
    ctrl.on_dead(1)
    live[:] = [5]
    assert _ready(ctrl, 5, 1, version=0, fresh=True)["status"] == "lost"
    ctrl.on_dead(5)
    with pytest.raises(RemoteError, match="not a live member"):  # a dead id is never admitted again
        _ready(ctrl, 5, 2, version=0, fresh=True)


def test_a_worker_that_left_for_another_strategy_comes_back_as_a_holder() -> None:
    """An adaptive job leaves partial reduce (``pr_leave``, not finished) and switches back: the
    workers' new strategy instances start their seqs again and are admitted with their models."""
    live = [0, 1, 2]
    ctrl = PRController(ControllerConfig(group_size=2), 3, now=lambda: 0.0, live=lambda: tuple(live))
    for wid in (0, 1):
        assert _ready(ctrl, wid, 1)["status"] in ("wait", "group")
    for wid in (0, 1, 2):
        ctrl.handle("pr_leave", {"worker_id": wid, "finished": False})
    live.append(3)  # (joined while the other strategy ran: it has the model too)
    assert _ready(ctrl, 3, 1, version=7)["status"] == "solo"  # the first back: nobody to average with
    assert _ready(ctrl, 3, 2, version=8)["status"] == "solo"
    assert _ready(ctrl, 0, 1, version=5)["status"] == "wait"  # admitted: a partner for the next
    b = _ready(ctrl, 3, 3, version=9)
    assert b["status"] == "group" and b["members"] == [0, 3] and b["weights"] == [0.5, 0.5]  # (CPR)
