"""The coordinator's side of a strategy switch at run time: it picks the step
(``cluster/switch_announce.py``) and announces it in every heartbeat reply; each worker switches
when it reaches it (``trainer/loop_machine.py``: under a vote the switch rides the vote).

``announce(option)`` is the API a policy calls in-process (issue 32's adaptive policy); the
``switch`` op is the same over the message plane.  Options are 1-based indices into the
workers' switch options (``WorkerOptions.switch_options``); a worker that lacks one logs it and
ignores the announcement.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from flotilla.cluster.switch_announce import Progress, SwitchRefused, announce_step
from flotilla.comm.schema import IntRange
from flotilla.core.errors import RemoteError
from flotilla.core.log import get_logger

__all__ = ["MAX_SWITCHES", "SwitchAnnouncer"]

log = get_logger("coordinator")

MAX_SWITCHES = 64  # announced in one job (every heartbeat reply carries them all)


class SwitchAnnouncer:
    def __init__(
        self, *, total_steps: int | None, lead_s: float, live: Callable[[], Mapping[int, Progress]]
    ) -> None:
        self.total_steps, self.lead_s, self._live = total_steps, lead_s, live
        self._lock = threading.Lock()
        self._switches: list[tuple[int, int]] = []  # (step, option), in announcement order

    def announce(self, option: int, *, not_before: int = 0) -> int:
        """Announce a switch to ``option``, at ``not_before`` at the earliest: the step it takes
        effect at (``SwitchRefused`` when no step is left before the end, or nobody trains)."""
        if option < 1:
            raise SwitchRefused(f"switch option must be >= 1, got {option}")
        step = announce_step(self._live(), lead_s=self.lead_s, total_steps=self.total_steps)
        step = max(step, not_before)
        with self._lock:
            if len(self._switches) >= MAX_SWITCHES:
                raise SwitchRefused(f"at most {MAX_SWITCHES} switches per job")
            if self._switches and step <= self._switches[-1][0]:
                step = self._switches[-1][0] + 1  # (announcements keep their order)
            if self.total_steps is not None and step >= self.total_steps:
                raise SwitchRefused(f"too late to switch: step {step} of {self.total_steps}")
            self._switches.append((step, option))
        log.info("strategy switch to option %d announced for step %d", option, step)
        return step

    def announced(self) -> list[list[int]]:
        """The heartbeat reply's ``switches``: ``[[step, option], ...]``."""
        with self._lock:
            return [[s, o] for s, o in self._switches]

    def handlers(self) -> dict[str, tuple[Callable[[Any], dict[str, Any]], dict[str, Any]]]:
        body = {"option": IntRange(1, 1 << 20), "not_before": (IntRange(0, 2**53), None)}
        return {"switch": (self._on_switch, body)}

    def _on_switch(self, req: Any) -> dict[str, Any]:
        b = req.body
        try:
            return {"step": self.announce(int(b["option"]), not_before=int(b.get("not_before") or 0))}
        except SwitchRefused as exc:
            raise RemoteError("switch_refused", str(exc)) from None
