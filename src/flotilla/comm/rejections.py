"""Rejected inputs, counted per reason and sender and logged as rate-limited summaries.

Every input a plane refuses (a message that fails a size, HMAC, decoding, header, replay, op or
schema check; a store value without a valid signature; a connection dropped for an oversized
frame) is handed to :meth:`Rejections.record`.  Nothing a peer sends decides how much is logged:

Invariants:
- At most one WARNING line per reason per ``interval_s`` (5 s by default), at the default log
  level: the first rejection of a reason is logged at once; later ones within the interval are
  counted and reported by the next line of that reason (``N more rejected in the last T s``,
  with the busiest senders).  :meth:`Rejections.flush` reports what is still pending (servers call
  it while idle), so no count is lost from the log for longer than an interval plus a poll.
- Memory is bounded: at most ``MAX_SENDERS`` distinct senders per reason are counted by name,
  the rest under ``"<other>"``; reasons and senders are cut to ``MAX_LABEL_CHARS``.
- The counters only grow; :func:`rejection_counts` returns a copy (``{reason: {sender: n}}``)
  for the run summary.  Each server keeps an instance of its own (its own rate limit) whose
  counts also go to the process-wide :data:`REJECTIONS` (``parent``), which the rendezvous store
  logs through directly and :func:`rejection_counts` reads.  Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from flotilla.core.log import get_logger

__all__ = [
    "MAX_LABEL_CHARS",
    "MAX_SENDERS",
    "REJECTIONS",
    "Rejections",
    "rejection_counts",
    "rejection_total",
]

MAX_SENDERS = 64
MAX_LABEL_CHARS = 64
OTHER = "<other>"
_TOP = 3


def _label(text: object) -> str:
    s = str(text)
    return s if len(s) <= MAX_LABEL_CHARS else s[: MAX_LABEL_CHARS - 1] + "~"


class _Reason:
    __slots__ = ("counts", "last_line", "pending", "pending_by", "detail", "where")

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.last_line: float | None = None
        self.pending = 0
        self.pending_by: dict[str, int] = {}
        self.detail = ""
        self.where = ""


class Rejections:
    """Counters and rate-limited WARNING summaries of rejected inputs (module doc)."""

    def __init__(
        self,
        *,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger | None = None,
        parent: Rejections | None = None,
        what: str = "message",
    ) -> None:
        self.interval_s = interval_s
        self._parent, self._what = parent, what
        self._clock = clock
        self._log = logger if logger is not None else get_logger("comm.rejections")
        self._lock = threading.Lock()
        self._reasons: dict[str, _Reason] = {}

    def record(self, reason: str, sender: str, detail: str = "", *, where: str = "") -> None:
        """Count one rejection of ``reason`` from ``sender`` (a claimed name or a transport peer;
        unauthenticated); log a summary line if none was logged for ``reason`` within the interval."""
        reason, sender = _label(reason), _label(sender)
        with self._lock:
            reason, r = self._count(reason, sender)
            if sender in r.pending_by or len(r.pending_by) < MAX_SENDERS:
                r.pending_by[sender] = r.pending_by.get(sender, 0) + 1
            r.pending += 1
            r.detail, r.where = detail[:200], where[:MAX_LABEL_CHARS]
            line = self._due(reason, r, self._clock())
        if self._parent is not None:
            self._parent.count(reason, sender)
        if line is not None:
            self._log.warning("%s", line)

    def count(self, reason: str, sender: str) -> None:
        """Count one rejection without logging it (a child instance logs its own summaries)."""
        with self._lock:
            self._count(_label(reason), _label(sender))

    def _count(self, reason: str, sender: str) -> tuple[str, _Reason]:
        r = self._reasons.get(reason)
        if r is None:
            if len(self._reasons) >= MAX_SENDERS:
                reason = OTHER
            r = self._reasons.setdefault(reason, _Reason())
        key = sender if sender in r.counts or len(r.counts) < MAX_SENDERS else OTHER
        r.counts[key] = r.counts.get(key, 0) + 1
        return reason, r

    def flush(self) -> None:
        """Log the pending count of every reason whose interval is over (cheap when none is)."""
        now = self._clock()
        with self._lock:
            lines = [ln for reason, r in self._reasons.items() if (ln := self._due(reason, r, now))]
        for line in lines:
            self._log.warning("%s", line)

    def _due(self, reason: str, r: _Reason, now: float) -> str | None:
        if r.pending == 0 or (r.last_line is not None and now - r.last_line < self.interval_s):
            return None
        since = "" if r.last_line is None else f" in the last {now - r.last_line:.1f} s"
        top = sorted(r.pending_by.items(), key=lambda kv: -kv[1])[:_TOP]
        senders = ", ".join(f"{s!r} x{n}" for s, n in top)
        more = "" if len(r.pending_by) <= _TOP else f" and {len(r.pending_by) - _TOP} more"
        where = f"{r.where}: " if r.where else ""
        line = (
            f"{where}rejected {self._what}(s) for {reason}: {r.pending}{since} "
            f"(from {senders}{more}; latest: {r.detail}); total {sum(r.counts.values())} "
            f"(at most one such line per {self.interval_s:g} s)"
        )
        r.last_line, r.pending, r.pending_by = now, 0, {}
        return line

    def counts(self) -> dict[str, dict[str, int]]:
        """``{reason: {sender: count}}`` since the process started (a copy)."""
        with self._lock:
            return {reason: dict(r.counts) for reason, r in self._reasons.items()}

    def total(self) -> int:
        with self._lock:
            return sum(sum(r.counts.values()) for r in self._reasons.values())


REJECTIONS = Rejections()
"""The process-wide instance every plane records into."""


def rejection_counts() -> dict[str, dict[str, int]]:
    """This process's rejections so far, ``{reason: {sender: count}}`` (for the run summary)."""
    return REJECTIONS.counts()


def rejection_total() -> int:
    """How many inputs this process rejected so far."""
    return REJECTIONS.total()
