"""``cluster.revocations.time_from_step``: the timed actions' clock starts once the job reached a
step (so that revocations begin when training does, on a slow machine as on a fast one) -- in the
pure plan, the config section and the launcher's executor (``launch/revocations.py``, driven
here with a fake supervisor and a step counter the test moves; waits are for events)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from flotilla.cluster.revocations import (
    Action,
    RandomRevocations,
    RevocationAction,
    RevocationError,
    RevocationSchedule,
    plan_revocations,
)
from flotilla.config.revocations import RevocationsConfig
from flotilla.launch.revocations import RevocationDriver

W4 = ("w0", "w1", "w2", "w3")


def test_the_plan_carries_the_step_on_timed_actions_only() -> None:
    events = (
        RevocationAction(action=Action.KILL, worker="w3", at_s=2.0),
        RevocationAction(action=Action.KILL, worker="w2", at_step=7),
    )
    rnd = RandomRevocations(mean_interval_s=1.0, seed=4, respawn_after_s=0.5, stop_s=5.0, min_alive=2)
    plain = plan_revocations(RevocationSchedule(events=events, random=rnd), W4)
    anchored = plan_revocations(RevocationSchedule(events=events, random=rnd, time_from_step=3), W4)
    assert [a.from_step for a in plain] == [None] * len(plain)
    assert [a.from_step for a in anchored] == [3 if a.timed else None for a in anchored]
    # the same actions at the same times otherwise: the anchor only moves the clock's start
    assert [(a.action, a.worker, a.at_s, a.at_step) for a in anchored] == [
        (a.action, a.worker, a.at_s, a.at_step) for a in plain
    ]


def test_bad_anchors_are_refused() -> None:
    with pytest.raises(RevocationError) as err:
        RevocationSchedule(time_from_step=-1)
    assert err.value.where == "time_from_step"
    with pytest.raises(ValueError, match="from_step"):
        RevocationAction(action=Action.KILL, worker="w0", at_step=3, from_step=1)
    with pytest.raises(ValidationError, match="time_from_step"):
        RevocationsConfig.model_validate({"time_from_step": -2})
    section = RevocationsConfig.model_validate(
        {"time_from_step": 5, "events": [{"at_s": 1, "action": "kill", "worker": "w1"}]}
    )
    assert [a.from_step for a in section.plan(W4)] == [5]


class _Sup:
    """The part of the launcher's ``Supervisor`` the driver uses: the live workers by name."""

    def __init__(self) -> None:
        self.children: list[Any] = []

    def alive(self, role: str) -> list[Any]:
        return list(self.children)


def _wait(pred: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_the_driver_starts_the_clock_when_the_job_reaches_the_step(tmp_path: Path) -> None:
    step = {"now": 0}
    spawned: list[tuple[str, float]] = []
    lock = threading.Lock()

    def spawn(name: str) -> Any:
        with lock:
            spawned.append((name, time.monotonic()))
        return SimpleNamespace(name=name, proc=SimpleNamespace(pid=4242), returncode=None)

    plan = (RevocationAction(action=Action.ADD, worker="w9", at_s=0.2, from_step=3),)
    t0 = time.monotonic()
    driver = RevocationDriver(
        plan,
        supervisor=_Sup(),  # type: ignore[arg-type]
        spawn_worker=spawn,
        job_step=lambda: step["now"],
        t0_monotonic=t0,
        log_path=tmp_path / "revocations.jsonl",
    ).start()
    try:
        assert not driver.adds_pending()  # (step 0, the clock starts at 3: with no worker left, never)
        step["now"] = 2
        _wait(lambda: time.monotonic() - t0 > 0.6, "time to pass")  # (far beyond at_s from t0)
        assert not spawned, "an action ran before its clock started"
        reached = time.monotonic()
        step["now"] = 3
        _wait(lambda: bool(driver.executed), "the add")
        # the added process is running: a launcher that listed no live worker just before the
        # add ran must still wait for it
        assert driver.adds_pending()
        driver._added[0].returncode = 0  # (it exited, and the supervisor reaped it)
        assert not driver.adds_pending()
    finally:
        driver.close()
    name, at = spawned[0]
    assert name == "w9" and at - reached >= 0.2  # at_s counted from the step, not from t0
    assert driver.executed[0]["time_s"] >= 0.8  # the record's time is still since t0


def test_an_add_at_a_step_the_job_has_not_reached_is_not_waited_for(tmp_path: Path) -> None:
    """A run whose every worker died with a stepped add pending (``at_step`` beyond the job's
    step) ended only at the test's timeout: with nobody left the step never advances."""
    step = {"now": 5}
    plan = (RevocationAction(action=Action.ADD, worker="w9", at_step=50),)
    driver = RevocationDriver(
        plan,
        supervisor=_Sup(),  # type: ignore[arg-type]
        spawn_worker=lambda name: SimpleNamespace(name=name, proc=SimpleNamespace(pid=1), returncode=None),
        job_step=lambda: step["now"],
        t0_monotonic=time.monotonic(),
        log_path=tmp_path / "revocations.jsonl",
    )  # (not started: the plan stays as it is)
    assert not driver.adds_pending()
    step["now"] = 50  # reached: the driver's thread is about to run it
    assert driver.adds_pending()
    timed = RevocationDriver(
        (RevocationAction(action=Action.ADD, worker="w9", at_s=1.0),),
        supervisor=_Sup(),  # type: ignore[arg-type]
        spawn_worker=lambda name: SimpleNamespace(name=name, proc=SimpleNamespace(pid=1), returncode=None),
        job_step=lambda: 0,
        t0_monotonic=time.monotonic(),
        log_path=tmp_path / "revocations2.jsonl",
    )
    assert timed.adds_pending()  # (its clock runs from t0: it will run)
