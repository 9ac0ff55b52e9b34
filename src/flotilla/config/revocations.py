"""The ``cluster.revocations`` section: explicit kill/stop/add events, a seeded random rate and the
replay of a spot-instance trace (SPEC §8), each optional.

The models here check each value on its own; ``ClusterConfig`` checks the section against its
workers with :func:`check_revocations` (unknown workers, a kill of a worker that is not alive, a
trace whose initial nodes do not match the workers, ...), and :meth:`RevocationsConfig.schedule`
hands the pure :class:`flotilla.cluster.revocations.RevocationSchedule` to the planner.

Example::

    cluster:
      num_workers: 4
      revocations:
        events:
          - {at_s: 5, action: kill, worker: w3, notice_s: 2}
          - {at_step: 40, action: stop, worker: w2, duration_s: 3}
          - {at_s: 20, action: add, worker: w3}        # restart
        random: {mean_interval_s: 30, seed: 1, respawn_after_s: 10, min_alive: 1}
        # or, instead of random:
        # trace: {file: traces/aws-p3-spot.csv, time_scale: 600, max_workers: 2, start_ms: 0}
        time_from_step: 1      # optional: at_s times count from when the job reached step 1

Invariants: the trace file is read and parsed while validating (so ``flotilla validate`` reports
a bad line with its number), and its events are kept on the model; a relative ``trace.file`` is
resolved by :func:`resolve_trace_path` against the config file's directory when the loader calls
it, else against the current directory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from flotilla.cluster.revocation_trace import TraceError, TraceEvent, TraceReplay, parse_trace
from flotilla.cluster.revocations import (
    Action,
    RandomRevocations,
    RevocationAction,
    RevocationError,
    RevocationSchedule,
    check_schedule,
    plan_revocations,
)
from flotilla.config.base import _fail, _matching, _Model

__all__ = [
    "RandomRevocationsConfig",
    "RevocationEvent",
    "RevocationsConfig",
    "TraceConfig",
    "check_revocations",
    "resolve_trace_path",
]

# the rule of cluster.WorkerName (defined here too: cluster.py imports this module)
_WorkerName = Annotated[str, _matching(r"[A-Za-z0-9_.-]{1,64}", "1-64 letters, digits, '_', '-' or '.'")]
_Seconds = Annotated[float, Field(ge=0)]
_Positive = Annotated[float, Field(gt=0)]
_Step = Annotated[int, Field(ge=0)]
_ONLY = {"notice_s": "kill", "duration_s": "stop"}  # fields only one action takes
_ARTICLE = {"kill": "a kill", "stop": "a stop", "add": "an add"}


class RevocationEvent(_Model):
    """One explicit event, at ``at_s`` seconds from the start of the run or at the start of step
    ``at_step`` (exactly one):

    - ``kill``: SIGKILL ``worker``; with ``notice_s``, SIGTERM at the event and SIGKILL
      ``notice_s`` later;
    - ``stop``: SIGSTOP ``worker``, SIGCONT ``duration_s`` later (a frozen VM, a long pause);
    - ``add``: start a worker process that joins: a name not in ``cluster.workers`` (it gets the
      cluster's defaults) or a worker killed earlier (restarted).

    One model with an ``action`` literal rather than a tagged union: the loader's error paths
    follow tagged unions in fields, not inside lists.
    """

    at_s: _Seconds | None = None
    at_step: _Step | None = None
    action: Literal["kill", "stop", "add"]
    worker: _WorkerName
    notice_s: _Positive | None = None
    duration_s: _Positive | None = None

    @model_validator(mode="after")
    def _check(self) -> RevocationEvent:
        if (self.at_s is None) == (self.at_step is None):
            got = "both" if self.at_s is not None else "neither"
            raise _fail(f"set exactly one of at_s (seconds), at_step (steps) (got {got})", "at_s")
        for key, owner in _ONLY.items():
            if getattr(self, key) is not None and owner != self.action:
                raise _fail(f"only a {owner} takes {key} (this event is {_ARTICLE[self.action]})", key)
        if self.action == "stop" and self.duration_s is None:
            raise _fail("a stop needs duration_s (seconds until SIGCONT)", "duration_s")
        return self

    def action_of(self) -> RevocationAction:
        """The pure event."""
        return RevocationAction(
            action=Action(self.action),
            worker=self.worker,
            at_s=self.at_s,
            at_step=self.at_step,
            notice_s=self.notice_s,
            duration_s=self.duration_s,
        )


class RandomRevocationsConfig(_Model):
    """Poisson kills of a random live worker that no event names, never below ``min_alive``
    alive, each restarted ``respawn_after_s`` later (null: never)."""

    mean_interval_s: _Positive
    seed: int = 0
    respawn_after_s: _Seconds | None
    start_s: _Seconds = 0.0
    stop_s: _Positive | None = None  # null: until the end of the run
    min_alive: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> RandomRevocationsConfig:
        if self.stop_s is not None and self.stop_s <= self.start_s:
            raise _fail(f"must be > start_s ({self.start_s:g}) (got {self.stop_s:g})", "stop_s")
        return self

    def random(self) -> RandomRevocations:
        """The pure random rate."""
        return RandomRevocations(**self.model_dump())


class TraceConfig(_Model):
    """Replay of a spot trace file (``time_ms,add|remove,node`` lines), ``time_scale`` trace
    seconds per run second, at most ``max_workers`` alive, from ``start_ms`` into the trace."""

    file: str = Field(min_length=1, max_length=4096)
    time_scale: _Positive = 1.0
    max_workers: int = Field(ge=1, le=4096)
    start_ms: int = Field(default=0, ge=0)
    _events: tuple[TraceEvent, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _read(self) -> TraceConfig:
        try:
            with open(self.file, encoding="utf-8") as handle:
                text = handle.read()
        except FileNotFoundError:
            raise _fail(
                f"no such trace file {self.file!r} (a relative path is resolved against the config "
                "file's directory)",
                "file",
            ) from None
        except (OSError, UnicodeDecodeError) as err:
            reason = getattr(err, "strerror", None) or str(err)
            raise _fail(f"cannot read trace file {self.file!r} ({reason})", "file") from None
        try:
            self._events = parse_trace(text, source=self.file)
        except TraceError as err:
            raise _fail(str(err), "file") from None
        return self

    def replay(self) -> TraceReplay:
        """The pure replay (the events parsed from the file)."""
        return TraceReplay(
            events=self._events,
            time_scale=self.time_scale,
            max_workers=self.max_workers,
            start_ms=self.start_ms,
        )


class RevocationsConfig(_Model):
    """Who is killed, stopped and added when: explicit ``events``, a ``random`` rate or a
    ``trace`` replay (random and trace exclude each other; either combines with events).
    ``time_from_step``: every time (``at_s``, the random rate's, the trace's) counts from the
    moment the job reached this step instead of from the job's start -- revocations then begin
    when training does, however long the workers took to start."""

    events: tuple[RevocationEvent, ...] = ()
    random: RandomRevocationsConfig | None = None
    trace: TraceConfig | None = None
    time_from_step: _Step | None = None

    @property
    def active(self) -> bool:
        """Whether anything is scheduled."""
        return bool(self.events) or self.random is not None or self.trace is not None

    @model_validator(mode="after")
    def _check(self) -> RevocationsConfig:
        if self.random is not None and self.trace is not None:
            raise _fail(
                "set random or trace, not both: both drive the workers that no event names "
                "(combine either with events)",
                "random",
            )
        return self

    def schedule(self) -> RevocationSchedule:
        """The pure schedule of this section."""
        return RevocationSchedule(
            events=tuple(event.action_of() for event in self.events),
            random=self.random.random() if self.random is not None else None,
            trace=self.trace.replay() if self.trace is not None else None,
            time_from_step=self.time_from_step,
        )

    def plan(
        self, workers: Sequence[str], *, horizon_s: float | None = None, horizon_steps: int | None = None
    ) -> tuple[RevocationAction, ...]:
        """The sorted plan on ``workers`` (see :func:`flotilla.cluster.revocations.plan_revocations`)."""
        return plan_revocations(self.schedule(), workers, horizon_s=horizon_s, horizon_steps=horizon_steps)


def check_revocations(
    section: RevocationsConfig, workers: Sequence[str], prefix: str = "revocations"
) -> None:
    """Check ``section`` against the cluster's worker names; for a validator: raises the
    config error of the culprit's field, ``<prefix>.<where>``."""
    try:
        check_schedule(section.schedule(), workers)
    except RevocationError as err:
        raise _fail(str(err), f"{prefix}.{err.where}") from None


def resolve_trace_path(data: dict[str, Any], base_dir: str) -> dict[str, Any]:
    """Make a relative ``cluster.revocations.trace.file`` absolute against ``base_dir`` (the
    config file's directory) if the file is there, else against the current directory (for the
    loader, beside :func:`flotilla.config.paths.resolve_task_path`)."""
    cluster = data.get("cluster")
    revocations = cluster.get("revocations") if isinstance(cluster, dict) else None
    trace = revocations.get("trace") if isinstance(revocations, dict) else None
    where = trace.get("file") if isinstance(trace, dict) else None
    if not isinstance(where, str) or not where or os.path.isabs(where):
        return data
    assert isinstance(cluster, dict) and isinstance(revocations, dict) and isinstance(trace, dict)
    for root in (base_dir, os.getcwd()):
        candidate = os.path.normpath(os.path.join(root, where))
        if os.path.isfile(candidate):
            resolved = {**revocations, "trace": {**trace, "file": candidate}}
            return {**data, "cluster": {**cluster, "revocations": resolved}}
    return data
