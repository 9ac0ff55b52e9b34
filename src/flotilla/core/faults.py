"""Fault plans: faults a test injects into the loop, by worker name, step and phase (torchft's
step-indexed ``EventInjector``).  The plan is data; the loop and the strategies call the hooks
it builds, and no role parses environment variables for faults.

Phases (where in a unit the fault fires):
- ``compute``: before the unit's forward pass (the worker dies while its peers compute or
  already wait in the all-reduce);
- ``sync``: inside the synchronisation, when the unit's second gradient bucket (or its only one)
  is launched -- the survivors are inside the all-reduce;
- ``boundary``: after the unit's boundary was carried out (the step committed or was discarded).

Actions: ``crash`` (exit code 17 at once, no notice: like SIGKILL), ``fail`` (the worker's part of
the unit fails locally -- ``sync`` phase only: the vote discards the step everywhere), ``delay``
(sleep ``delay_s``: a straggler or a frozen peer), ``stop`` (SIGSTOP to its own process, every
thread frozen -- at ``sync``: inside the all-reduce; the test sends the SIGCONT).

A plan travels to child processes as JSON (``FaultPlan.to_json``/``from_json``; the CLI reads it
from ``$FLOTILLA_FAULTS``); the old ``NAME@STEP`` spelling (crash at ``sync``) is accepted.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

__all__ = ["ENV_VAR", "Fault", "FaultPlan", "InjectedFault"]

ENV_VAR = "FLOTILLA_FAULTS"
LEGACY_ENV_VAR = "FLOTILLA_FAULT_CRASH"
PHASES = ("compute", "sync", "boundary")
ACTIONS = ("crash", "fail", "delay", "stop")
CRASH_EXIT_CODE = 17


class InjectedFault(Exception):
    """Raised by a fault hook to simulate a local failure while reducing one bucket."""


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
    if fault.action == "fail":
        raise InjectedFault(f"injected failure at step {fault.step}")


@dataclass(frozen=True, slots=True)
class FaultPlan:
    faults: tuple[Fault, ...] = ()

    def of(self, worker: str | None, phase: str) -> dict[int, Fault]:
        return {f.step: f for f in self.faults if f.worker == worker and f.phase == phase}

    def phase_hook(self, worker: str | None) -> Callable[[int, str], None] | None:
        """``hook(step, phase)`` for the loop (phases ``compute`` and ``boundary``)."""
        mine = {(f.step, f.phase): f for f in self.faults if f.worker == worker and f.phase != "sync"}
        if not mine:
            return None

        def hook(step: int, phase: str) -> None:
            fault = mine.get((step, phase))
            if fault is not None:
                _fire(fault)

        return hook

    def bucket_hook(self, worker: str | None) -> Callable[[int, int, int], None] | None:
        """``hook(step, bucket, num_buckets)`` for a bucketed all-reduce (phase ``sync``)."""
        mine = self.of(worker, "sync")
        if not mine:
            return None

        def hook(step: int, bucket: int, num_buckets: int) -> None:
            fault = mine.get(step)
            if fault is not None and bucket == min(1, num_buckets - 1):
                _fire(fault)

        return hook

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
