"""The zygote: one process per run that imports torch and flotilla's roles once, then forks every
role process the run starts (``python -m flotilla.launch.zygote REQUESTS_FD REPLIES_FD``).

Why: a role process started by ``exec`` spends ~2.5-3 s of CPU importing Python, torch,
``torch._dynamo`` and flotilla before it does anything (measured on the 2-core VM: a 5-step
``flotilla run examples/tiny.yaml`` cost 5.4 s of CPU with one worker, 14.0 s with four).  On
a machine whose cores the workers share, that is CPU taken from training, and it is on the path
of every restart: a worker respawned after a revocation, a pipeline stage or a virtual worker
coming back.  A child forked from the zygote has all of it already (copy-on-write).

What a forked child gets is what ``exec`` would have given it (``launch/supervisor.spawn``'s
contract): its own session (so a signal to its process group reaches everything it starts),
death with its parent (``PR_SET_PDEATHSIG``; the zygote itself dies with the launcher), its
command line as ``ps`` shows it (``setproctitle``: tools find a run's processes by it), stdin
from ``/dev/null``, stdout and stderr appended to its log, the request's working directory,
environment (``os.environ`` replaced in place: C code reads it too) and import path (the
request's ``PYTHONPATH`` before the interpreter's own entries), fresh seeds from the OS for
Python's, NumPy's and torch's global random generators, as a fresh interpreter has (a forked
child would otherwise repeat its siblings' draws), and then
``runpy.run_module(module, run_name="__main__")`` with the request's argv, as ``python -m
module`` does.  The zygote answers a request with the child's pid only after the
child is its own session leader (``os.killpg(pid)`` reaches it from the first moment).

Safety: the zygote starts no Python thread, touches no accelerator and opens no socket; it
refuses to fork (and says so: the launcher then starts children by ``exec``) if its preload
left a Python thread running or started native threads beyond ``import torch``'s.  torch's one native
helper thread of import time is the one every fork-based ``DataLoader`` worker also inherits.

Protocol (JSON lines over two pipes; local to one machine, never a socket, never pickle):
the zygote says ``{"ready": true, "preload_s": S}`` (or ``{"refused": why}``); a request
``{"argv": [...], "env": {...}, "cwd": ..., "log": ...}`` is answered ``{"pid": N}`` or
``{"error": why}``; each child's exit is reported ``{"exited": pid, "code": C}`` (``C`` as
``subprocess.Popen.returncode``: negative for a signal).  The zygote exits when its request
pipe closes (its children then die with it).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

__all__ = ["PRELOAD", "Request", "decode_request", "encode"]

# What a role process imports before it trains: torch and torch._dynamo (the first optimizer
# imports it), the CLI and every role's module (their imports pull in the strategies, comm, ...).
PRELOAD = (
    "torch",
    "torch._dynamo",
    "numpy",
    "zmq",
    "safetensors.torch",
    "flotilla.cli.main",
    "flotilla.roles.worker",
    "flotilla.roles.stage_worker",
    "flotilla.roles.stage",
    "flotilla.roles.ps_server",
    "flotilla.roles.ps_replica",
)

_SYNC_TIMEOUT_S = 30.0  # a child says it is its own session leader within this
_MAX_LINE = 1 << 24  # a request holds an environment: far below this


@dataclass(frozen=True, slots=True)
class Request:
    """One process to fork: ``python -m module *args`` as ``argv`` says (``argv[0]`` is the
    interpreter, ``argv[1] == "-m"``), with ``env``, ``cwd`` and output appended to ``log``."""

    module: str
    args: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    log: str


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode_request(line: bytes) -> Request:
    """A request line as :class:`Request`; ``ValueError`` naming what is wrong."""
    msg = json.loads(line)
    if not isinstance(msg, dict):
        raise ValueError("a request must be a JSON object")
    argv, env, cwd, log = msg.get("argv"), msg.get("env"), msg.get("cwd"), msg.get("log")
    if not (isinstance(argv, list) and len(argv) >= 3 and all(isinstance(a, str) for a in argv)):
        raise ValueError("argv must be a list of strings: [python, -m, module, ...]")
    if argv[1] != "-m":
        raise ValueError(f"argv must run a module (python -m module ...), got {argv[:2]}")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError("env must map strings to strings")
    if not isinstance(cwd, str) or not isinstance(log, str):
        raise ValueError("cwd and log must be strings")
    return Request(module=argv[2], args=tuple(argv[3:]), env=dict(env), cwd=cwd, log=log)


class _Lines:
    """Whole lines read from a pipe by ``os.read`` (no buffered reader whose state a child
    would inherit)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""
        self.closed = False

    def read(self) -> list[bytes]:
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            self.closed = True
            return []
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        if len(self.buf) > _MAX_LINE:
            raise ValueError("a request line is too long")
        return [line for line in lines if line.strip()]


class _Zygote:
    def __init__(self, requests_fd: int, replies_fd: int) -> None:
        self.requests = _Lines(requests_fd)
        self.replies_fd = replies_fd
        self.pid = os.getpid()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.base_path = _base_path(sys.path, os.environ.get("PYTHONPATH", ""))

    def say(self, message: dict[str, Any]) -> None:
        data = encode(message)
        while data:
            data = data[os.write(self.replies_fd, data) :]

    def serve(self) -> tuple[Request, int] | None:
        """Answer requests until the request pipe closes (``None``: the zygote ends) or this
        process is a freshly forked child (its request and the pipe it tells the zygote on)."""
        signal.signal(signal.SIGCHLD, lambda *_: None)  # (wakes the select through the fd)
        signal.set_wakeup_fd(self.wake_w)
        while not self.requests.closed:
            ready, _, _ = select.select([self.requests.fd, self.wake_r], [], [])
            if self.wake_r in ready:
                _drain(self.wake_r)
                self.reap()
            if self.requests.fd not in ready:
                continue
            for line in self.requests.read():
                try:
                    request = decode_request(line)
                except ValueError as exc:
                    self.say({"error": f"bad request: {exc}"})
                    continue
                child = self.fork(request)
                if child is not None:
                    return child
        return None

    def fork(self, request: Request) -> tuple[Request, int] | None:
        if threading.active_count() != 1:
            self.say({"error": "the zygote has a Python thread running: it does not fork"})
            return None
        sync_r, sync_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(sync_r)
            return request, sync_w
        os.close(sync_w)
        # the child is its own session leader (or died trying: EOF); bounded, so that a child
        # stuck before it could say so never stops this loop from reaping and answering
        ready, _, _ = select.select([sync_r], [], [], _SYNC_TIMEOUT_S)
        ok = os.read(sync_r, 1) if ready else b""
        os.close(sync_r)
        if ok == b"1":
            self.say({"pid": pid})
            return None
        if not ready:
            os.kill(pid, signal.SIGKILL)  # (reaped and reported like any child)
        self.say({"error": f"child {pid} did not start ({'timed out' if not ready else 'it died'})"})
        return None

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            self.say({"exited": pid, "code": code})

    def become(self, request: Request, sync_w: int) -> None:
        """In the forked child: turn into the requested process, as ``exec`` would have."""
        from flotilla.launch.supervisor import _die_with_parent as die_with_parent

        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (self.requests.fd, self.replies_fd, self.wake_r, self.wake_w):
            os.close(fd)
        os.setsid()
        die_with_parent()  # (the supervisor's own: the same prctl as for an exec'd child)
        if os.getppid() != self.pid:  # (the zygote died before the prctl)
            os._exit(1)
        os.write(sync_w, b"1")  # (killpg(pid) reaches it from now on)
        os.close(sync_w)
        _set_title(" ".join([sys.executable, "-m", request.module, *request.args]))
        out = os.open(request.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        os.chdir(request.cwd)
        os.environ.clear()
        os.environ.update(request.env)
        extra = [p for p in request.env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.getcwd(), *dict.fromkeys(extra), *self.base_path]
        importlib.invalidate_caches()  # (directory listings cached by the preload's imports)
        _reseed()
        sys.argv = [request.module, *request.args]
        sys.modules.pop(request.module, None)  # (as in a fresh ``python -m``: run, not imported)


def _base_path(path: list[str], pythonpath: str) -> list[str]:
    """The interpreter's own import path: ``sys.path`` without its first entry (the script's or
    the working directory) and without the ``PYTHONPATH`` entries."""
    extra = {os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p}
    return [p for p in path[1:] if os.path.abspath(p) not in extra]


def _set_title(title: str) -> None:
    """Show the child as ``exec`` would have (``ps``, ``/proc/PID/cmdline``: tools and tests
    find a run's processes by their command line)."""
    try:
        import setproctitle
    except ImportError:  # (an install without it: the zygote's command line, which names the run)
        return
    setproctitle.setproctitle(title)


def _reseed() -> None:
    import random

    import torch

    torch.seed()  # (a fresh interpreter seeds it from the OS too)
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _preload() -> tuple[float, str | None]:
    """Import :data:`PRELOAD`: the CPU time it took, and why the zygote must not fork (``None``:
    it may) -- a Python thread left running, or native threads beyond those ``import torch``
    starts (e.g. an OpenMP team: a forked child could hang in it)."""
    start = time.process_time()
    import torch  # noqa: F401

    native = _native_threads()
    for name in PRELOAD:
        importlib.import_module(name)
    took = time.process_time() - start
    if threading.active_count() != 1:
        return took, f"the preload left {threading.active_count() - 1} Python thread(s) running"
    if native is not None and (_native_threads() or 0) > native:
        return took, f"the preload started native threads ({_native_threads()} against {native})"
    return took, None


def _native_threads() -> int | None:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # (no /proc: the Python check alone)
        return None


def main(argv: list[str]) -> None:
    requests_fd, replies_fd = int(argv[0]), int(argv[1])  # (argv[2:]: what it serves, for ps)
    zygote = _Zygote(requests_fd, replies_fd)
    os.set_blocking(zygote.wake_r, False)
    try:
        preload_s, unsafe = _preload()
    except Exception:  # (a broken install: the launcher starts its children by exec)
        zygote.say({"refused": "preload failed: " + traceback.format_exc(limit=3)})
        return
    if unsafe is not None:
        zygote.say({"refused": unsafe})
        return
    zygote.say({"ready": True, "preload_s": round(preload_s, 3)})
    child = zygote.serve()
    if child is None:
        return
    request, sync_w = child
    try:
        zygote.become(request, sync_w)
    except BaseException:  # (nothing was run yet: say why in the child's log)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    import runpy

    runpy.run_module(request.module, run_name="__main__", alter_sys=True)
    sys.exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
