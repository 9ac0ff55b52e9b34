"""The launcher's side of the zygote (``launch/zygote.py``): start it, ask it for children, and
hand each one back as a :class:`ForkedProc` that behaves as the ``subprocess.Popen`` the
supervisor would otherwise hold (``pid``, ``poll``, ``wait``, ``returncode``, ``send_signal``,
``kill``, ``terminate``).

A forked child is the zygote's, not the launcher's, so its exit status comes from the zygote's
reports (a reader thread); signals go through a pidfd where the OS has them (no pid reuse race).
If the zygote cannot start, refuses, or dies, :meth:`Zygote.spawn` returns ``None`` and the
supervisor starts the child by ``exec`` as before: the zygote only ever saves time.  Children
of a zygote that died are killed with it (``PR_SET_PDEATHSIG``) and reported with ``-SIGKILL``.

``$FLOTILLA_SPAWN``: ``fork`` (the default) or ``exec`` (never use a zygote).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flotilla.core.errors import ConfigError
from flotilla.core.log import get_logger

__all__ = ["SPAWN_VAR", "ForkedProc", "Zygote", "fork_allowed", "zygote_wanted"]

log = get_logger("zygote")

SPAWN_VAR = "FLOTILLA_SPAWN"
_READY_TIMEOUT_S = 120.0  # the preload: ~3 s of CPU, more on a loaded machine
_REPLY_TIMEOUT_S = 30.0


def zygote_wanted(env: dict[str, str] | os._Environ[str]) -> bool:
    """Whether ``$FLOTILLA_SPAWN`` lets a run fork its children from a zygote."""
    value = env.get(SPAWN_VAR, "fork").strip().lower()
    if value not in ("fork", "exec"):
        raise ConfigError(f"${SPAWN_VAR} must be 'fork' or 'exec', got {value!r}")
    return value == "fork" and hasattr(os, "fork") and sys.platform.startswith("linux")


def fork_allowed(cfg: Any) -> bool:
    """Whether a job's children may be forked: not where a worker computes on CUDA (the GPU
    paths are checked with processes started by exec: forking is not tried there)."""
    return not any(w.device == "cuda" for w in cfg.cluster.resolved_workers())


class ForkedProc:
    """A child forked by the zygote, seen as a ``subprocess.Popen``."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self._zygote = zygote
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._lock = threading.Lock()  # (the launcher's threads poll and signal it at once)
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = None

    def _gone(self) -> bool:
        """(Under the lock.)  The process has exited (its report may still be on its way)."""
        if self._pidfd is not None:
            poller = select.poll()
            poller.register(self._pidfd, select.POLLIN)
            return bool(poller.poll(0))
        return not _exists(self.pid)

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                code = self._zygote.exit_code(self.pid)
                if code is None and self._gone():  # (exited: its report follows within moments)
                    code = self._zygote.wait_exit_code(self.pid, 2.0)
                if code is not None:
                    self._set(code)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._zygote.wait_exit_code(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            with self._lock:
                if self.returncode is None:
                    self._set(code)
        assert self.returncode is not None
        return self.returncode

    def _set(self, code: int) -> None:
        """(Under the lock.)"""
        self.returncode = code
        fd, self._pidfd = self._pidfd, None
        if fd is not None:
            os.close(fd)

    def send_signal(self, sig: int) -> None:
        """Signal it while it runs (through its pidfd: never another process that took its pid)."""
        if self.poll() is not None:
            return
        with self._lock:
            if self.returncode is not None:
                return
            try:
                if self._pidfd is not None:
                    signal.pidfd_send_signal(self._pidfd, sig)
                else:
                    os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """One zygote process and the reader of its reports (module docstring)."""

    def __init__(self, env: dict[str, str], log_path: Path, *, die_with_parent: Callable[[], None]) -> None:
        req_r, self._req_w = os.pipe()
        self._rep_r, rep_w = os.pipe()
        self._asked = 0  # requests written and not answered yet
        self._cond = threading.Condition()
        self._exits: dict[int, int] = {}
        self._forked: set[int] = set()
        self._replies: list[dict] = []
        self._state = "starting"  # -> ready | dead
        self._lock = threading.Lock()  # one request at a time
        try:
            out = open(log_path, "ab")
        except OSError:
            for fd in (req_r, self._req_w, self._rep_r, rep_w):
                os.close(fd)
            raise
        try:  # (its command line names the run: a run's processes are found by it)
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "flotilla.launch.zygote",
                    str(req_r),
                    str(rep_w),
                    str(log_path.parent),
                ],
                pass_fds=(req_r, rep_w),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
                env=env,
            )
        except OSError:
            os.close(self._req_w)
            os.close(self._rep_r)
            raise
        finally:
            out.close()
            os.close(req_r)
            os.close(rep_w)
        self._reader = threading.Thread(target=self._read, name="zygote-reports", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buf = b""
        try:
            while True:
                try:
                    chunk = os.read(self._rep_r, 1 << 16)
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    self._on(json.loads(line))
        except Exception:  # (a report it cannot read: served no more)
            log.exception("the zygote's reports cannot be read: children start by exec")
        finally:
            self._died()

    def _on(self, msg: dict) -> None:
        with self._cond:
            if "exited" in msg:
                self._exits[int(msg["exited"])] = int(msg["code"])
            elif msg.get("ready"):
                if self._state == "starting":  # (not after it was given up)
                    self._state = "ready"
                log.debug("zygote ready: its preload took %.2f s of CPU", float(msg.get("preload_s", 0.0)))
            elif "refused" in msg:
                self._state = "dead"
                log.warning("the zygote refused to fork (children start by exec): %s", msg["refused"])
            else:
                if "pid" in msg:  # (an earlier process with this pid was reported before this)
                    self._exits.pop(int(msg["pid"]), None)
                if self._asked > 0:
                    self._asked -= 1
                    self._replies.append(msg)
                elif "pid" in msg:  # (the answer to a request given up: nobody holds it)
                    _kill(int(msg["pid"]))
            self._cond.notify_all()

    def _died(self) -> None:
        """The zygote is gone: its children died with it; report each as killed once it is."""
        with self._cond:
            self._state = "dead"
            self._cond.notify_all()
            pending = [p for p in self._forked if p not in self._exits]
        deadline = time.monotonic() + 10.0
        while pending and time.monotonic() < deadline:
            pending = [p for p in pending if _exists(p)]
            time.sleep(0.02)
        with self._cond:
            for pid in self._forked:
                self._exits.setdefault(pid, -signal.SIGKILL)
            self._cond.notify_all()

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid)

    def wait_exit_code(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits, timeout)
            return self._exits.get(pid)

    def spawn(self, cmd: list[str], log_path: Path, env: dict[str, str]) -> ForkedProc | None:
        """Fork ``cmd`` (``python -m module ...``), or ``None`` where the zygote cannot (the
        caller then starts it by exec)."""
        if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-m":
            return None
        request = {"argv": cmd, "env": env, "cwd": os.getcwd(), "log": str(log_path)}
        with self._lock:
            with self._cond:
                if not self._cond.wait_for(lambda: self._state != "starting", _READY_TIMEOUT_S):
                    log.warning(
                        "the zygote did not get ready in %.0f s: children start by exec", _READY_TIMEOUT_S
                    )
                    self._state = "dead"
                if self._state != "ready":
                    return None
            data = json.dumps(request).encode() + b"\n"
            with self._cond:
                self._asked += 1
            try:
                while data:
                    data = data[os.write(self._req_w, data) :]
            except OSError:
                with self._cond:
                    self._asked -= 1
                return None
            with self._cond:
                if not self._cond.wait_for(lambda: self._replies or self._state == "dead", _REPLY_TIMEOUT_S):
                    self._asked = 0  # (a late answer is nobody's: its child is killed)
                    log.warning(
                        "the zygote did not answer in %.0f s: children start by exec", _REPLY_TIMEOUT_S
                    )
                    self._state = "dead"  # (a late answer must not be read as the next one's)
                if not self._replies or self._state == "dead":
                    return None
                reply = self._replies.pop(0)
                if "pid" not in reply:
                    log.warning("the zygote did not fork %s: %s", cmd[2:4], reply.get("error"))
                    return None
                pid = int(reply["pid"])
                self._forked.add(pid)
        return ForkedProc(self, pid, cmd)

    def close(self) -> None:
        """End the zygote (its request pipe closes); children still running die with it."""
        with self._lock:  # (not while a spawn writes to the pipe)
            if self._req_w < 0:
                return
            os.close(self._req_w)
            self._req_w = -1
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._reader.join(timeout=15)
        try:
            os.close(self._rep_r)
        except OSError:
            pass


def _exists(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
