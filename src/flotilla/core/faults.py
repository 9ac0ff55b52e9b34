"""Fault plans: faults a test injects into the loop, by worker name, step and phase (torchft's
step-indexed ``EventInjector``).  The plan is data; the loop and the strategies call the hooks
it builds, and no role parses environment variables for faults.

Phases (where in a unit the fault fires):
- ``compute``: before the unit's forward pass (the worker dies while its peers compute or
  already wait in the all-reduce);
- ``sync``: inside the synchronisation, when the unit's first collective is launched (a gradient
  bucket during backward, a partial-reduce group's all-reduce, DiLoCo's delta) -- the survivors
  are inside the all-reduce, waiting for this worker;
- ``boundary``: at the end of a unit's boundary (the step committed or was discarded, its duties
  done, and any view change or switch it led to carried out), keyed by the step the loop is at
  then; the boundary that ends the run (finished, stopped, non-finite) has no such point;
- ``finish``: at the job's end, on the worker about to report the job's result (rank 0, or one
  that took over from it: its final weights made, nothing reported yet), if the job ends at a step
  at or after the fault's.

A unit's ``compute`` and ``sync`` faults are keyed by its first step (a DiLoCo unit of H steps:
the step it starts at).  A ``sync`` fault whose unit launched no collective (a partial-reduce
group aborted before its all-reduce) fires in the next unit that launches one.

Actions: ``crash`` (exit code 17 at once, no notice: like SIGKILL), ``fail`` (the worker's part of
the unit fails locally -- ``sync`` phase only: its vote says so and every member discards the
step; a strategy without a vote has nothing to fail), ``delay`` (sleep ``delay_s``: a straggler or
a frozen peer), ``stop`` (SIGSTOP to its own process, every thread frozen -- at ``sync``: inside
the all-reduce; the test sends the SIGCONT).  Each fault fires once per process.

Where they fire (:class:`FaultInjector`, installed by the role that builds the parts; no loop or
strategy holds a fault call site): ``compute`` in :class:`FaultyEngine`, which wraps the loop's
engine; ``sync`` at the group's collectives (``comm.collective.CollectiveFaults``: the roles'
group factories hand the injector to every group they build); ``boundary`` in a loop boundary
hook (``Loop.boundary_hooks``); ``finish`` in the worker's duties (``roles/worker_duties.py``).

A plan travels to child processes as JSON (``FaultPlan.to_json``/``from_json``; the CLI reads it
from ``$FLOTILLA_FAULTS``); the old ``NAME@STEP`` spelling (crash at ``sync``) is accepted.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["ENV_VAR", "Fault", "FaultInjector", "FaultPlan", "FaultyEngine"]

ENV_VAR = "FLOTILLA_FAULTS"
LEGACY_ENV_VAR = "FLOTILLA_FAULT_CRASH"
PHASES = ("compute", "sync", "boundary", "finish")
ACTIONS = ("crash", "fail", "delay", "stop")
CRASH_EXIT_CODE = 17


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    worker: str
    step: int
    phase: str = "sync"
    action: str = "crash"
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"Fault.phase must be one of {', '.join(PHASES)}; got {self.phase!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"Fault.action must be one of {', '.join(ACTIONS)}; got {self.action!r}")
        if self.action == "fail" and self.phase != "sync":
            raise ValueError("Fault.action 'fail' needs phase 'sync'")
        if self.step < 0 or self.delay_s < 0:
            raise ValueError("Fault.step and Fault.delay_s must be >= 0")


def _fire(fault: Fault) -> None:
    if fault.action == "crash":
        from flotilla.core.log import get_logger

        get_logger("faults").error("fault injection: %s crashing at step %d (%s)", fault.worker, fault.step,
                                   fault.phase)  # fmt: skip
        os._exit(CRASH_EXIT_CODE)
    if fault.action == "delay":
        time.sleep(fault.delay_s)
    if fault.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # (returns once someone sends SIGCONT)


@dataclass(frozen=True, slots=True)
class FaultPlan:
    faults: tuple[Fault, ...] = ()

    def of(self, worker: str | None, phase: str) -> dict[int, Fault]:
        return {f.step: f for f in self.faults if f.worker == worker and f.phase == phase}

    def to_json(self) -> str:
        return json.dumps([asdict(f) for f in self.faults])

    @classmethod
    def from_json(cls, text: str) -> FaultPlan:
        raw = json.loads(text)
        if not isinstance(raw, list):
            raise ValueError("a fault plan is a JSON list of faults")
        return cls(tuple(Fault(**f) for f in raw))

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> FaultPlan:
        """``$FLOTILLA_FAULTS`` (JSON), or the legacy ``$FLOTILLA_FAULT_CRASH=NAME@STEP``."""
        if env.get(ENV_VAR):
            return cls.from_json(env[ENV_VAR])
        legacy = env.get(LEGACY_ENV_VAR, "")
        who, _, at = legacy.partition("@")
        if legacy and who and at.isdigit():
            return cls((Fault(worker=who, step=int(at), phase="sync"),))
        return cls()


class FaultInjector:
    """One worker's faults of a plan, fired where they belong (module doc).  ``active``: the
    worker has faults at all (a role installs nothing otherwise)."""

    def __init__(self, plan: FaultPlan, worker: str | None) -> None:
        self._compute = plan.of(worker, "compute")
        self._sync = plan.of(worker, "sync")
        self._boundary = plan.of(worker, "boundary")
        self._finish = plan.of(worker, "finish")
        self._armed: Fault | None = None  # the sync fault of the running unit, until it fires
        self._due: list[Fault] = []  # sync faults due, oldest first, until a unit's collective fires one
        self._fired: set[tuple[int, str]] = set()

    @property
    def active(self) -> bool:
        return bool(self._compute or self._sync or self._boundary or self._finish)

    def _once(self, fault: Fault | None) -> Fault | None:
        if fault is None or (fault.step, fault.phase) in self._fired:
            return None
        self._fired.add((fault.step, fault.phase))
        return fault

    def unit_started(self, step: int) -> None:
        """A unit starting at ``step``: its ``compute`` fault fires; its ``sync`` fault, or one
        still due from an earlier unit that launched no collective, is armed."""
        own = self._sync.get(step)
        if own is not None and (own.step, own.phase) not in self._fired and own not in self._due:
            self._due.append(own)
        self._armed = self._due[0] if self._due else None
        fault = self._once(self._compute.get(step))
        if fault is not None:
            _fire(fault)

    def unit_ended(self) -> None:
        """A sync fault the unit did not reach (it launched no collective: a partial-reduce group
        aborted before its all-reduce, say) waits for the next *unit's* first collective, not for
        the next collective between units (a view's state agreement, say)."""
        self._armed = None

    def launching(self, group: Any) -> None:
        """(``comm.collective.CollectiveFaults``) the unit's first collective: its sync fault."""
        fault = self._armed
        if fault is not None and fault.action != "fail":
            self._armed = None
            self._due.remove(fault)
            if self._once(fault) is not None:
                _fire(fault)

    def voting(self, group: Any, tensor: Any) -> None:
        """(``comm.collective.CollectiveFaults``) a ``fail`` fault: this member's vote fails."""
        fault = self._armed
        if fault is not None and fault.action == "fail":
            self._armed = None
            self._due.remove(fault)
            if self._once(fault) is not None:
                tensor[0] = max(float(tensor[0]), 1.0)

    def engine(self, engine: Any) -> Any:
        """The loop's engine, wrapped when this worker has ``compute`` or ``sync`` faults."""
        return FaultyEngine(engine, self) if self._compute or self._sync else engine

    def boundary_hook(self, loop: Any) -> None:
        """(``Loop.boundary_hooks``) the ``boundary`` fault of the step the loop is at."""
        fault = self._once(self._boundary.get(int(loop.step)))
        if fault is not None:
            _fire(fault)

    def reporting(self, step: int) -> None:
        """(``roles/worker_duties.py``) about to report the job's result, which ends at ``step``:
        the ``finish`` faults at or before it."""
        for at in sorted(self._finish):
            fault = self._once(self._finish[at]) if at <= step else None
            if fault is not None:
                _fire(fault)


class FaultyEngine:
    """The loop's engine with a :class:`FaultInjector` told of every unit before it runs; the
    rest is the engine's (``step`` and ``has_state`` read and written through)."""

    def __init__(self, inner: Any, injector: FaultInjector) -> None:
        self.__dict__["_inner"], self.__dict__["_injector"] = inner, injector

    @property
    def step(self) -> int:
        return int(self._inner.step)

    @step.setter
    def step(self, value: int) -> None:
        self._inner.step = value

    @property
    def has_state(self) -> bool:
        return bool(self._inner.has_state)

    @has_state.setter
    def has_state(self, value: bool) -> None:
        self._inner.has_state = value

    def run_unit(self, where: Any, strategy: Any, proposal: Any) -> Any:
        self._injector.unit_started(int(where.first_step))
        try:
            return self._inner.run_unit(where, strategy, proposal)
        finally:
            self._injector.unit_ended()

    def export_state(self) -> tuple[dict[str, Any], list[Any]]:
        return self._inner.export_state()

    def import_state(self, meta: dict[str, Any], tensors: list[Any]) -> None:
        self._inner.import_state(meta, tensors)

    def digest(self) -> str:
        return str(self._inner.digest())

    def after_commit(self) -> None:
        self._inner.after_commit()

    def average(self, group: Any) -> None:
        self._inner.average(group)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_inner"], name)
