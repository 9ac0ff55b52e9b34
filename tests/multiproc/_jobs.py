"""Helpers to drive real `flotilla` processes from tests, always cleaning up.

Waits are for events (a record, a file, a process's exit), polled; their timeouts are safety nets
sized far above what any machine needs, never the thing a test measures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from flotilla.report.metrics import read_jsonl

FLOTILLA = [sys.executable, "-m", "flotilla.cli.main"]
ROOT = Path(__file__).resolve().parents[2]


def start(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    fh = open(log, "wb")
    try:
        return subprocess.Popen(
            FLOTILLA + args,
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    finally:
        fh.close()


# A `flotilla` command whose process imports everything first, says so (``GO.ready``), then waits
# for ``GO`` to hold its arguments (JSON): the command then starts in milliseconds, on any machine.
_HELD = """
import json, os, sys, time
from pathlib import Path
import flotilla.cli.main as cli, flotilla.roles.worker, torch  # the slow part: imports
go = Path(sys.argv[1])
Path(str(go) + ".ready").touch()
while not go.exists():
    time.sleep(0.005)
sys.argv = ["flotilla", *json.loads(go.read_text())]
sys.exit(cli.app())
"""


def start_held(go: Path, log: Path, env: dict | None = None) -> subprocess.Popen:
    """Start a `flotilla` process that waits, imported, for :func:`release`."""
    fh = open(log, "wb")
    try:
        return subprocess.Popen(
            [sys.executable, "-c", _HELD, str(go)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    finally:
        fh.close()


def held_ready(go: Path) -> bool:
    return Path(f"{go}.ready").exists()


def release(go: Path, args: list[str]) -> None:
    """Run the held process's command with ``args`` (written whole: temp file, then rename)."""
    tmp = go.with_name(go.name + ".tmp")
    tmp.write_text(json.dumps(args))
    os.replace(tmp, go)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def run_summary(config: str, tmp: Path, *sets: str, timeout_s: float = 280.0) -> dict:
    """``flotilla run CONFIG --set ...`` with its report and run directories under ``tmp``: it must
    exit 0 and leave no process behind; returns its ``summary.json``."""
    args = ["run", config, "--report", str(tmp / "report"), "--run-dir", str(tmp / "run"), "--no-progress"]
    proc = start([*args, *(x for kv in sets for x in ("--set", kv))], tmp / "launcher.log")
    try:
        assert proc.wait(timeout=timeout_s) == 0, (tmp / "launcher.log").read_text()[-3000:]
    finally:
        stop(proc)
    assert processes_mentioning(str(tmp)) == []
    return json.loads((tmp / "report" / "summary.json").read_text())


def interrupt(proc: subprocess.Popen) -> None:
    """What a terminal's Ctrl-C does: SIGINT to the launcher's process group (a clean stop)."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except ProcessLookupError:
        pass


def records(report: Path) -> list[dict]:
    return read_jsonl(report / "metrics.jsonl", missing_ok=True)


def wait_for(pred: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains ``text`` (e.g. a run directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and int(entry) != os.getpid() and alive(int(entry)):
            found.append(int(entry))
    return found


def training_steps(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r.get("kind") != "eval"]
