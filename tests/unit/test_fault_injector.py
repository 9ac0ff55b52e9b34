"""``core/faults.FaultInjector``: each phase fires where it belongs, once, for its own worker only;
and no loop or strategy module holds a fault call site (issue 37 item 4)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flotilla.core.faults import Fault, FaultInjector, FaultPlan, FaultyEngine

from ._source import SRC, names_in


class _Engine:
    def __init__(self) -> None:
        self.step, self.has_state, self.ran = 0, False, []
        self.extra = "mine"

    def run_unit(self, where: Any, strategy: Any, proposal: Any) -> str:
        self.ran.append(where.first_step)
        return "result"

    def export_state(self) -> tuple[dict[str, Any], list[Any]]:
        return {"step": self.step}, []

    def import_state(self, meta: dict[str, Any], tensors: list[Any]) -> None:
        self.step = int(meta["step"])

    def digest(self) -> str:
        return "d"

    def after_commit(self) -> None:
        pass

    def average(self, group: Any) -> None:
        pass


class _Where:
    def __init__(self, first_step: int) -> None:
        self.first_step = first_step


def _delays(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr("flotilla.core.faults.time.sleep", slept.append)
    return slept


def test_compute_fires_before_the_unit_once_and_only_for_its_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    slept = _delays(monkeypatch)
    plan = FaultPlan((Fault(worker="w1", step=3, phase="compute", action="delay", delay_s=0.5),))
    other = FaultInjector(plan, "w0")
    assert not other.active and other.engine(inner := _Engine()) is inner  # nothing installed
    mine = FaultInjector(plan, "w1")
    engine = mine.engine(_Engine())
    assert isinstance(engine, FaultyEngine)
    for step in (2, 3, 3):  # step 3 twice: a redo does not fire it again
        assert engine.run_unit(_Where(step), None, None) == "result"
    assert slept == [0.5]
    engine.step, engine.has_state = 7, True  # written through to the engine
    assert engine._inner.step == 7 and engine._inner.has_state and engine.extra == "mine"
    assert engine.export_state() == ({"step": 7}, [])


def test_sync_fires_at_the_units_first_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    slept = _delays(monkeypatch)
    plan = FaultPlan((Fault(worker="w", step=4, phase="sync", action="delay", delay_s=1.0),))
    faults = FaultInjector(plan, "w")
    faults.launching(None)  # (no unit yet: a view's state agreement)
    faults.unit_started(3)
    faults.launching(None)
    assert slept == []
    faults.unit_started(4)
    faults.launching(None)
    faults.launching(None)  # (the unit's second collective: already fired)
    assert slept == [1.0]
    late = FaultInjector(plan, "w")
    late.unit_started(4)
    late.unit_ended()  # (a unit that launched no collective)
    late.launching(None)  # (the next view's state agreement: not the unit's)
    assert slept == [1.0]
    late.unit_started(5)  # the next unit that launches a collective: the fault still due fires
    late.launching(None)
    late.unit_ended()
    late.unit_started(6)
    late.launching(None)
    assert slept == [1.0, 1.0]
    # a fault still due when the next unit has its own: the older fires first, then the own one
    two = FaultPlan(tuple(Fault(worker="w", step=k, phase="sync", action="delay", delay_s=k) for k in (1, 2)))
    both = FaultInjector(two, "w")
    both.unit_started(1)
    both.unit_ended()  # (no collective: step 1's fault stays due)
    both.unit_started(2)
    both.launching(None)
    both.unit_ended()
    both.unit_started(3)
    both.launching(None)
    assert slept == [1.0, 1.0, 1.0, 2.0]


def test_fail_marks_this_members_vote_once() -> None:
    plan = FaultPlan((Fault(worker="w", step=2, phase="sync", action="fail"),))
    faults = FaultInjector(plan, "w")
    for step, expected in ((1, 0.0), (2, 1.0), (2, 0.0)):  # the redo of step 2 commits
        faults.unit_started(step)
        faults.launching(None)  # (a fail waits for the vote)
        vote = torch.zeros(4, dtype=torch.float64)
        faults.voting(None, vote)
        assert vote[0].item() == expected, step
    nonfinite = torch.tensor([2.0, 0, 0, 0], dtype=torch.float64)
    again = FaultInjector(plan, "w")
    again.unit_started(2)
    again.voting(None, nonfinite)
    assert nonfinite[0].item() == 2.0  # a worse code stays


def test_boundary_fires_at_the_loops_step(monkeypatch: pytest.MonkeyPatch) -> None:
    slept = _delays(monkeypatch)
    plan = FaultPlan((Fault(worker="s", step=8, phase="boundary", action="delay", delay_s=2.0),))
    faults = FaultInjector(plan, "s")
    assert faults.active and faults.engine(inner := _Engine()) is inner  # (no compute/sync fault)

    class _Loop:
        step = 7

    loop = _Loop()
    faults.boundary_hook(loop)
    loop.step = 8
    faults.boundary_hook(loop)
    faults.boundary_hook(loop)
    assert slept == [2.0]


def test_finish_fires_once_on_the_reporter_of_a_job_ending_at_or_after_its_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept = _delays(monkeypatch)
    plan = FaultPlan((Fault(worker="s", step=50, phase="finish", action="delay", delay_s=3.0),))
    faults = FaultInjector(plan, "s")
    assert faults.active and not FaultInjector(plan, "other").active
    faults.reporting(49)  # (a job ending before the fault's step: nothing)
    assert slept == []
    faults.reporting(60)
    faults.reporting(60)
    assert slept == [3.0]


@pytest.mark.parametrize("package", ["trainer", "sync"])
def test_no_loop_or_strategy_module_holds_a_fault_call_site(package: str) -> None:
    """Faults reach the loop and the strategies only through the parts the roles install."""
    fault_names = {"faults", "FaultInjector", "FaultPlan", "FaultyEngine", "fault_hook", "on_phase",
                   "InjectedFault", "launching", "voting"}  # fmt: skip
    offenders = {
        str(path.relative_to(SRC)): sorted(names_in(path) & fault_names)
        for path in sorted((SRC / package).glob("*.py"))
        if names_in(path) & fault_names
    }
    assert not offenders, offenders
