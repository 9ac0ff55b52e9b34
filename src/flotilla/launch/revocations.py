"""Executes a revocation schedule (``cluster.revocations``, planned by the pure
``cluster/revocations.py``) on the worker processes of a local run (SPEC §8).

- ``kill``: SIGKILL, without notice -- or, with ``notice_s``, SIGTERM first (the worker leaves at
  its next step boundary) and SIGKILL ``notice_s`` later if it is still there;
- ``stop``: SIGSTOP, and SIGCONT ``duration_s`` later (a frozen machine that comes back);
- ``add``: a new worker process with that name, which joins as a newcomer (a restart when the
  name was killed before).

Revocation is **without notice to the coordinator**: the exit of a process this driver killed is
not turned into a death notice (``revoked``), so the survivors find out as they would on a real
cluster -- their ring neighbours stop answering (``roles/peer_link.py``) or a collective fails.

Time: ``at_s`` counts from the job's start (the coordinator's t0, given as ``t0_monotonic``), or,
when the plan's timed actions carry ``from_step`` (``cluster.revocations.time_from_step``), from
the moment the job's most advanced worker was first seen at that step; ``at_step`` actions run
once the job's most advanced worker has reached that step (the step is polled from the
coordinator every 0.1 s, only while such actions or the clock's start remain).  Every executed
action is appended to ``<run_dir>/revocations.jsonl`` (``time_s`` since t0, whatever the clock's
start, action, worker, pid) for the report.

One thread; ``close`` stops it and resumes whatever it left stopped.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from flotilla.cluster.revocations import Action, RevocationAction
from flotilla.core.log import get_logger
from flotilla.launch.supervisor import Child, Supervisor
from flotilla.pipeline.layout import device_of

__all__ = ["REVOCATION_HORIZON_S", "RevocationDriver", "start_revocations", "start_stage_revocations"]

REVOCATION_HORIZON_S = 7 * 24 * 3600.0  # a random schedule without stop_s: planned this far

log = get_logger("revocations")

STEP_POLL_S = 0.1


class RevocationDriver:
    def __init__(
        self,
        plan: Sequence[RevocationAction],
        *,
        supervisor: Supervisor,
        spawn_worker: Callable[[str], Child | None],
        job_step: Callable[[], int],
        t0_monotonic: float,
        log_path: Path,
        on_record: Callable[[dict[str, Any]], None] | None = None,
        role: str = "worker",
        machine_of: Callable[[str], str] = str,
        revoke_idle: Callable[[str], None] | None = None,
    ) -> None:
        # (``role``: the supervisor's processes it revokes; ``machine_of(process name)``: the
        # worker a process runs on -- a pipeline's ``d1~7`` runs on ``d1``; ``spawn_worker`` may
        # start nothing: a pipeline's add makes a device free, the launcher starts its stages)
        self._role, self._machine_of, self._revoke_idle = role, machine_of, revoke_idle
        self._on_record = on_record  # (the coordinator's trackers mark each revocation)
        self._timed = sorted((a for a in plan if a.at_s is not None), key=lambda a: float(a.at_s or 0.0))
        self._stepped = sorted((a for a in plan if a.at_step is not None), key=lambda a: int(a.at_step or 0))
        self._sup, self._spawn, self._job_step = supervisor, spawn_worker, job_step
        self._t0, self._log_path = t0_monotonic, log_path
        # the timed actions' clock: t0, or once the job reaches ``from_step`` (one per plan)
        self._from_step = next((a.from_step for a in self._timed if a.from_step is not None), None)
        self._clock0: float | None = t0_monotonic if self._from_step is None else None
        self._later: list[tuple[float, str, Child]] = []  # (when, "kill" | "cont", child)
        self._revoked: set[int] = set()
        self._stopped: dict[int, Child] = {}  # pid -> the child stopped
        self._added: list[Child] = []  # the processes started by adds
        self._adding = 0  # adds taken off the plan and not started yet
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="revocations", daemon=True)
        self.executed: list[dict[str, Any]] = []

    def start(self) -> RevocationDriver:
        self._thread.start()
        return self

    def revoked(self, child: Child) -> bool:
        """Whether ``child`` exited because this driver killed it (no death notice then)."""
        with self._lock:
            return child.proc.pid in self._revoked

    def adds_pending(self) -> bool:
        """Whether a worker can still be started, or one this driver started has not been seen
        to exit (a run with no worker left waits for it: the caller's list of live workers may
        predate an add that ran since).  With no worker left the job's step no longer advances,
        so an add at a step it has not reached -- or timed from such a step -- never runs: it
        does not count (the run would wait for it forever)."""
        step = self._job_step()
        with self._lock:
            clock = self._clock0 is not None or (self._from_step is not None and step >= self._from_step)
            timed = clock and any(a.action is Action.ADD for a in self._timed)
            stepped = any(a.action is Action.ADD and int(a.at_step or 0) <= step for a in self._stepped)
            if self._adding or timed or stepped:
                return True
            return any(child.returncode is None for child in self._added)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            self._due_later(now)
            self._start_clock(now)
            with self._lock:
                due = [a for a in self._timed if self._due_at(a) <= now]
                self._timed = self._timed[len(due) :]
                self._adding += sum(a.action is Action.ADD for a in due)
            if self._stepped:
                step = self._job_step()
                with self._lock:
                    ready = [a for a in self._stepped if int(a.at_step or 0) <= step]
                    self._stepped = self._stepped[len(ready) :]
                    self._adding += sum(a.action is Action.ADD for a in ready)
                due += ready
            for action in due:
                try:
                    self._execute(action)
                except Exception:
                    log.exception("revocation %s of %s failed", action.action.value, action.worker)
            self._stop.wait(self._next_wait(time.monotonic()))

    def _start_clock(self, now: float) -> None:
        """Start the timed actions' clock once the job has reached ``from_step``."""
        if self._clock0 is not None or self._from_step is None:
            return
        step = self._job_step()
        if step >= self._from_step:
            self._clock0 = now
            log.warning("revocation clock started: the job reached step %d at %.2f s", step, now - self._t0)

    def _due_at(self, action: RevocationAction) -> float:
        """When a timed action is due (never, while its clock has not started)."""
        return float("inf") if self._clock0 is None else self._clock0 + float(action.at_s or 0.0)

    def _next_wait(self, now: float) -> float:
        with self._lock:
            times = [self._due_at(a) for a in self._timed[:1]] + [t for t, _, _ in self._later]
            wait = min(times, default=now + 3600.0) - now
            if self._stepped or (self._clock0 is None and self._timed):
                wait = min(wait, STEP_POLL_S)
        return max(0.0, wait)

    def _due_later(self, now: float) -> None:
        with self._lock:
            due = [x for x in self._later if x[0] <= now]
            self._later = [x for x in self._later if x[0] > now]
        for _, what, child in due:
            if what == "kill":
                self._signal(child, signal.SIGKILL)
            else:
                self._signal(child, signal.SIGCONT)
                with self._lock:
                    self._stopped.pop(child.proc.pid, None)

    def _execute(self, action: RevocationAction) -> None:
        now = time.monotonic()
        if action.action is Action.ADD:
            try:
                started = self._spawn(action.worker)
                with self._lock:
                    if started is not None:
                        self._added.append(started)
            finally:
                with self._lock:
                    self._adding -= 1
            self._record(action, started.proc.pid if started is not None else 0)
            return
        alive = reversed(self._sup.alive(self._role))
        child = next((c for c in alive if self._machine_of(c.name) == action.worker), None)
        if child is None and action.action is Action.KILL and self._revoke_idle is not None:
            self._revoke_idle(action.worker)  # (a device no process runs on: revoked all the same)
            self._record(action, 0)
            return
        if child is None:
            log.warning(
                "revocation: %s %s skipped, no such worker process is running",
                action.action.value,
                action.worker,
            )
            return
        pid = child.proc.pid
        if action.action is Action.KILL:
            with self._lock:
                self._revoked.add(pid)
            if action.notice_s is not None:
                self._signal(child, signal.SIGTERM)
                with self._lock:
                    self._later.append((now + action.notice_s, "kill", child))
            else:
                self._signal(child, signal.SIGKILL)
        else:  # STOP
            self._signal(child, signal.SIGSTOP)
            with self._lock:
                self._stopped[pid] = child
                self._later.append((now + float(action.duration_s or 0.0), "cont", child))
        self._record(action, pid)

    @staticmethod
    def _signal(child: Child, sig: int) -> None:
        """Through the child's handle: a process that exited is not signalled (its pid may be
        another process's by now)."""
        try:
            child.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def _record(self, action: RevocationAction, pid: int) -> None:
        entry = {
            "time_s": round(time.monotonic() - self._t0, 3),
            "action": action.action.value,
            "worker": action.worker,
            "pid": pid,
            "step": self._job_step(),  # the furthest step the launcher had seen (its marker's step)
        }
        if action.notice_s is not None:
            entry["notice_s"] = action.notice_s
        if action.duration_s is not None:
            entry["duration_s"] = action.duration_s
        log.warning(
            "revocation: %s %s (pid %s) at %.2f s",
            action.action.value,
            action.worker,
            pid or "none",
            entry["time_s"],
        )
        self.executed.append(entry)
        with open(self._log_path, "a") as fh:
            fh.write(json.dumps(entry) + "\n")
        if self._on_record is not None:
            self._on_record(entry)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock:
            stopped = list(self._stopped.values())
            self._stopped.clear()
        for child in stopped:  # nothing is left frozen
            self._signal(child, signal.SIGCONT)


def start_revocations(
    cfg: Any,
    coord: Any,
    *,
    supervisor: Supervisor,
    spawn_worker: Callable[[str], Child],
    steps: int,
    log_path: Path,
) -> RevocationDriver | None:
    """The run configuration's revocation schedule (``cfg.cluster.revocations``), executed from the
    job's start against the coordinator ``coord``'s progress (None: no schedule)."""
    if not cfg.cluster.revocations.active:
        return None
    plan = cfg.cluster.revocation_plan(horizon_s=REVOCATION_HORIZON_S, horizon_steps=steps)
    if not plan:
        return None

    def job_step() -> int:
        return max((int(w.get("step", 0)) for w in coord.snapshot()["workers"]), default=0)

    driver = RevocationDriver(
        plan,
        supervisor=supervisor,
        spawn_worker=spawn_worker,
        job_step=job_step,
        t0_monotonic=time.monotonic() - float(coord.snapshot()["elapsed_s"]),
        log_path=Path(log_path),
        on_record=lambda e: coord.note_event(
            "revocation", f"{e['action']} {e['worker']} (pid {e['pid']})", e.get("step")
        ),
    )
    return driver.start()


def start_stage_revocations(
    cfg: Any,
    *,
    supervisor: Supervisor,
    arrive: Callable[[str], None],
    revoke: Callable[[str], None],
    job_step: Callable[[], int],
    steps: int,
    log_path: Path,
) -> RevocationDriver | None:
    """The schedule executed on a pipeline job's stage processes, where the strategy forms a lost
    instance again on other devices (hetpipe's ``reform``): ``kill`` and ``stop`` act on the
    stage process running on the worker (the device) named; ``add`` makes that device free
    (``arrive``) and starts nothing -- the launcher starts stages on it when it forms an instance;
    a ``kill`` of a device no stage runs on revokes it all the same (``revoke``).  Time counts
    from now (the job's start); ``job_step``: the furthest step the job's stages reported."""
    if not cfg.cluster.revocations.active:
        return None
    plan = cfg.cluster.revocation_plan(horizon_s=REVOCATION_HORIZON_S, horizon_steps=steps)
    if not plan:
        return None

    driver = RevocationDriver(
        plan,
        supervisor=supervisor,
        spawn_worker=arrive,
        job_step=job_step,
        t0_monotonic=time.monotonic(),
        log_path=Path(log_path),
        role="stage",
        machine_of=device_of,
        revoke_idle=revoke,
    )
    return driver.start()
