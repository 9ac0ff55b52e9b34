"""One supervisor for every child process of a run: workers, parameter servers, pipeline stages.

``Supervisor`` starts each child, watches it and stops it:

- ``spawn`` starts ``cmd`` in its own session (so a signal to its process group reaches everything
  it started), with ``PR_SET_PDEATHSIG`` = SIGKILL on Linux (it dies if the launcher dies, even by
  SIGKILL), stdin closed and stdout+stderr appended to a log file in the run directory; its
  environment is the launcher's with the launcher's import roots on ``PYTHONPATH`` and the number
  of the run's compute processes on this machine (``local_procs``) as ``$FLOTILLA_LOCAL_PROCS``;
  a ``python -m module`` child is forked from the run's zygote, which imported torch and the
  roles once (``launch/zygote.py``: the same contract, ~2.5 s of CPU less per child), unless
  ``fork=False`` or ``$FLOTILLA_SPAWN=exec``; anything else, or a zygote that cannot serve, is
  started by ``exec``;
- ``reap`` polls every child; a child that has exited is reported exactly once: its
  ``on_exit(child, returncode)`` callback runs and it is returned to the caller;
- ``wait_exit(timeout_s)`` sleeps until a child exits or the time is up, woken by the kernel (a
  pidfd per child, Linux >= 5.3), not by polling: a launcher that polled every 10 ms cost a
  training process with two intra-op threads on two cores 5% of its speed (its wake-ups
  preempt one of the team, whose barrier then waits); elsewhere it polls every 10 ms;
- ``stop`` ends a role's children: optionally SIGTERM first (servers write their final snapshot on
  it; workers treat SIGTERM as "leave", so they are asked to stop through the coordinator instead),
  then up to ``grace_s`` for them to exit by themselves, then SIGKILL to each survivor's whole
  process group, and a wait for every one of them;
- used as a context manager, leaving the ``with`` block (success, failure or Ctrl-C) kills and reaps
  whatever is still running: no process is left behind.
"""

from __future__ import annotations

import ctypes
import os
import selectors
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from flotilla.cluster.gpu_placement import ONE_HOST_VAR
from flotilla.core.log import get_logger
from flotilla.core.threads import LOCAL_PROCS_VAR
from flotilla.launch.zygote_client import ForkedProc, Zygote, zygote_wanted

__all__ = ["Child", "ExitHandler", "Supervisor", "child_env", "error_line", "exit_cause", "kill_all", "spawn"]

log = get_logger("supervisor")

_PR_SET_PDEATHSIG = 1

_LIBC: ctypes.CDLL | None
try:  # loaded once in the parent: nothing may be loaded between fork and exec
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not glibc/Linux: children then rely on the coordinator-lost timeout
    _LIBC = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(slots=True)
class Child:
    """A started role process (worker, server or pipeline stage) and where its log goes."""

    name: str
    proc: subprocess.Popen[bytes] | ForkedProc
    log_path: Path
    role: str = "worker"
    on_exit: ExitHandler | None = None
    exit_handled: bool = False
    pidfd: int | None = None  # readable once the process has exited (None: not available here)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def log_tail(self, num_lines: int = 3) -> str:
        """The last lines of its log, joined with `` | `` (for error messages)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(text.strip().splitlines()[-num_lines:])


ExitHandler = Callable[[Child, int], None]

_POLL_S = 0.01  # wait_exit's polling where there are no pidfds


def _pidfd(pid: int) -> int | None:
    """A file descriptor that becomes readable when ``pid`` exits, where the OS has them."""
    open_fd = getattr(os, "pidfd_open", None)
    if open_fd is None:
        return None
    try:
        return int(open_fd(pid))
    except OSError:  # (kernel < 5.3, or a sandbox without the call)
        return None


def _close_pidfd(child: Child) -> None:
    if child.pidfd is not None:
        os.close(child.pidfd)
        child.pidfd = None


def child_env(local_procs: int | None = None) -> dict[str, str]:
    """This process's environment, with its import roots (the current directory and, when started
    as ``python script.py``, the script's directory) on ``PYTHONPATH``: a child imports the user's
    task modules exactly as this process did (a task *file* puts its own directory on the path
    wherever it is loaded, ``trainer/task_load``).  ``local_procs``: how many compute processes
    the run starts on this machine, as ``$FLOTILLA_LOCAL_PROCS`` (each child's intra-op threads
    follow it, ``core/threads.py``)."""
    env = os.environ.copy()
    env[ONE_HOST_VAR] = "1"  # (every role it starts runs on this machine: cluster/gpu_placement.py)
    roots = [os.getcwd()] + ([sys.path[0]] if sys.path and sys.path[0] else [])
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*roots, *extra]))
    if local_procs is not None:
        env[LOCAL_PROCS_VAR] = str(local_procs)
    return env


def spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``cmd``: own session, killed with its parent, output appended to ``log_path``."""
    fh = open(log_path, "ab")
    try:
        return subprocess.Popen(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            env=env or child_env(),
        )
    finally:
        fh.close()


def kill_all(children: Iterable[Child], grace_s: float = 3.0) -> None:
    """Reap every child; whatever is still alive after ``grace_s`` gets SIGKILL (its whole group)."""
    children = list(children)
    deadline = time.monotonic() + grace_s
    for c in children:
        while c.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if c.proc.poll() is None:
            try:
                os.killpg(c.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for c in children:
        try:
            c.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("%s %s (pid %d) did not die", c.role, c.name, c.proc.pid)


class Supervisor:
    """Owns the child processes of one run (see the module docstring)."""

    def __init__(self, run_dir: Path, *, local_procs: int | None = None, fork: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.children: list[Child] = []
        self.local_procs = local_procs  # compute processes of the run on this machine (child_env)
        self._fork = fork and zygote_wanted(os.environ)  # (a bad $FLOTILLA_SPAWN: refused here)
        self._zygote: Zygote | None = None  # (started by the first spawn: nothing before it)
        self._end_zygote: weakref.finalize | None = None  # (also when dropped unclosed)

    def _zygote_for_spawn(self) -> Zygote | None:
        if self._fork and self._zygote is None and self._end_zygote is None:
            try:
                self._zygote = Zygote(
                    child_env(self.local_procs), self.run_dir / "zygote.log", die_with_parent=_die_with_parent
                )
                self._end_zygote = weakref.finalize(self, self._zygote.close)
            except OSError as exc:
                self._fork = False
                log.warning("no zygote (children start by exec): %s", exc)
        return self._zygote

    def spawn(
        self,
        name: str,
        cmd: list[str],
        *,
        role: str,
        log_name: str | None = None,
        on_exit: ExitHandler | None = None,
    ) -> Child:
        """Start one child; its log is ``<run_dir>/<log_name or name>.log``."""
        log_path = self.run_dir / f"{log_name or name}.log"
        env = child_env(self.local_procs)
        zygote = self._zygote_for_spawn()
        forked = zygote.spawn(cmd, log_path, env) if zygote is not None else None
        proc = forked if forked is not None else spawn(cmd, log_path, env=env)
        child = Child(name=name, proc=proc, log_path=log_path, role=role, on_exit=on_exit)
        child.pidfd = _pidfd(proc.pid)
        self.children.append(child)
        return child

    def wait_exit(self, timeout_s: float) -> None:
        """Return when a child not yet reaped has exited, or after ``timeout_s``."""
        pending = [c for c in self.children if not c.exit_handled]
        if any(c.proc.poll() is not None for c in pending):
            return
        fds = [c.pidfd for c in pending if c.pidfd is not None]
        if len(fds) < len(pending):  # (no pidfds here: poll)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and not any(c.proc.poll() is not None for c in pending):
                time.sleep(_POLL_S)
            return
        with selectors.DefaultSelector() as sel:
            for fd in fds:
                sel.register(fd, selectors.EVENT_READ)
            sel.select(timeout_s)

    def _of(self, role: str | None) -> list[Child]:
        return [c for c in self.children if role is None or c.role == role]

    def reap(self) -> list[Child]:
        """Children that exited since the last call (each reported once), after their callbacks."""
        exited = []
        for c in self.children:
            rc = c.proc.poll()
            if rc is None or c.exit_handled:
                continue
            c.exit_handled = True
            _close_pidfd(c)
            if c.on_exit is not None:
                c.on_exit(c, rc)
            exited.append(c)
        return exited

    def alive(self, role: str | None = None) -> list[Child]:
        """The role's children (all with ``None``) still running."""
        return [c for c in self._of(role) if c.proc.poll() is None]

    def exit_codes(self, role: str | None = None) -> dict[str, int | None]:
        """Name -> exit code (``None``: still running) of the role's children."""
        return {c.name: c.proc.returncode for c in self._of(role)}

    def stop(self, role: str | None = None, *, grace_s: float = 3.0, terminate: bool = False) -> None:
        """Stop the role's children: SIGTERM first with ``terminate``, SIGKILL after ``grace_s``."""
        children = self._of(role)
        if terminate:
            for c in children:
                if c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
        kill_all(children, grace_s=grace_s)

    def close(self) -> None:
        """Kill and reap every child still running (no grace)."""
        kill_all(self.alive(), grace_s=0.0)
        for c in self.children:
            _close_pidfd(c)
        if self._end_zygote is not None:
            self._end_zygote()  # (once; a later spawn starts its child by exec)
            self._zygote = None

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _log_lines(child: Child) -> list[str]:
    try:
        return child.log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def _last_error(lines: list[str]) -> str | None:
    """The last ``error: ...`` line a child printed (its prefix removed), or None."""
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    return errors[-1] if errors else None


def error_line(child: Child, fallback: str) -> str:
    """The ``error: ...`` line a child printed before it exited (its log's last one), else
    ``fallback`` with the log's tail."""
    found = _last_error(_log_lines(child))
    return found if found is not None else f"{fallback}: {child.log_tail()}"


def exit_cause(child: Child, limit: int = 300) -> str:
    """Why a child that exited with an error says it did, in one line: its last ``error: ...``
    line, else the exception that ended it (the text after the last traceback box: a message
    the traceback wrapped is joined), else ""."""
    lines = _log_lines(child)
    found = _last_error(lines)
    if found is not None:
        return found[:limit]
    ends = [i for i, line in enumerate(lines) if line.startswith("╰")]  # (rich's traceback box)
    after = lines[ends[-1] + 1 :] if ends else [ln for ln in lines if "Error: " in ln][-1:]
    return " ".join(line.strip() for line in after if line.strip())[:limit]
