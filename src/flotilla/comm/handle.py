"""An in-flight collective and its waits (``comm/collective.py`` launches them and re-exports
``Handle``): a wait is sliced (``WAIT_SLICE_S``) so that another thread's ``Group.abort``
releases it within one slice, and it measures how long this process did not run while it
waited (``Handle.longest_gap_s``, what ``Group.vote`` refuses a step on)."""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flotilla.core.errors import CollectiveError

if TYPE_CHECKING:
    from flotilla.comm.collective import Group

__all__ = ["WAIT_SLICE_S", "Handle", "first_line"]


def _td(seconds: float) -> _dt.timedelta:
    return _dt.timedelta(seconds=seconds)


WAIT_SLICE_S = 0.05
"""A wait checks for an abort at least this often (a completed collective returns at once)."""


class Handle:
    """An in-flight collective; ``wait`` raises CollectiveError on failure, timeout or abort, then
    runs ``after`` (copying a staged result back into the caller's tensor)."""

    __slots__ = ("_work", "_group", "_after", "_sliced", "longest_gap_s", "__weakref__")

    def __init__(
        self, work: Any, group: Group, after: Callable[[], Any] | None = None, *, sliced: bool = True
    ) -> None:
        self._work = work
        self._group = group
        self._after = after
        self._sliced = sliced
        self.longest_gap_s = 0.0  # (set by ``wait``: see there)
        group._handles.add(self)

    def wait(self, since: float | None = None) -> None:
        """Wait for the work.  ``longest_gap_s`` becomes the longest time this wait spent beyond
        what it asked for between two looks at the work (the first look from ``since``, a
        ``time.monotonic()`` reading): a sliced wait asks for ``WAIT_SLICE_S`` at a time, so
        time beyond that means this process did not run (it was frozen or starved) while the
        collective was in flight -- not that a peer was late."""
        g = self._group
        deadline = time.monotonic() + g.timeout_s
        seen, asked = (deadline - g.timeout_s if since is None else since), 0.0
        while True:
            work = self._work
            if work is None or g.aborted:
                self._work = None
                raise CollectiveError(f"{g.namespace}: group {g.abort_reason or 'closed'}")
            now = time.monotonic()
            self.longest_gap_s, seen = max(self.longest_gap_s, now - seen - asked), now
            left = deadline - now
            asked = max(0.0, min(WAIT_SLICE_S, left) if self._sliced else left)
            try:
                work.wait(_td(asked))
                now = time.monotonic()
                self.longest_gap_s = max(self.longest_gap_s, now - seen - asked)
                break
            except Exception as exc:
                if _timed_out(exc) and left > WAIT_SLICE_S:
                    continue  # one slice is over: check for an abort, then wait on
                self._work = None
                del work
                g.fail(f"collective failed: {first_line(exc)}")
                raise CollectiveError(f"{g.namespace}: collective failed: {first_line(exc)}") from None
        self._work = None
        if self._after is not None:
            self._after()

    def is_completed(self) -> bool:
        """True once the work finished (or was dropped); never blocks."""
        work = self._work
        return work is None or bool(work.is_completed())

    def drop(self) -> None:
        self._work = None


def _timed_out(exc: Exception) -> bool:
    return "timed out" in str(exc).lower()


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
