"""``flotilla run``: the embedded local cluster (one coordinator in-process, N worker processes).

Guarantees
- The per-cluster secret is generated here, written to ``<run_dir>/secret`` (mode 0600) and handed
  to workers by file path, never on a command line.
- Every child runs in its own session and is killed if this process dies (PR_SET_PDEATHSIG on
  Linux), and on success, on failure and on Ctrl-C the launcher kills and reaps every child before
  it returns: no process is left behind.
- A worker that dies unexpectedly is removed from the membership (survivors continue); the run
  fails only if no worker is left.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from flotilla.comm.auth import generate_secret, write_secret_file
from flotilla.config import RunConfig
from flotilla.core.atomic_io import atomic_write_json
from flotilla.core.errors import FlotillaError
from flotilla.core.log import get_logger
from flotilla.core.procs import Child
from flotilla.launch.progress import Progress
from flotilla.roles.coordinator import Coordinator
from flotilla.trainer import builders

log = get_logger("launcher")

_PR_SET_PDEATHSIG = 1


try:  # loaded once in the parent: nothing may be loaded between fork and exec
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not glibc/Linux: children then rely on the coordinator-lost timeout
    _LIBC = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(slots=True)
class RunResult:
    summary: dict
    run_dir: Path
    exit_code: int
    worker_exit_codes: dict[str, int] = field(default_factory=dict)


def worker_command(address: str, secret_file: Path, name: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "flotilla.cli.main",
        "worker",
        "--coordinator",
        address,
        "--secret-file",
        str(secret_file),
        "--name",
        name,
    ]


def spawn(cmd: list[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
    fh = open(log_path, "ab")
    try:
        return subprocess.Popen(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            env=env or os.environ.copy(),
        )
    finally:
        fh.close()


def kill_all(children: list[Child], grace_s: float = 3.0) -> None:
    """Reap every child; whatever is still alive after ``grace_s`` gets SIGKILL (its whole group).

    SIGTERM is not used: workers treat it as "leave".  A graceful stop is asked for through the
    coordinator's stop flag before this is called.
    """
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
            log.error("worker %s (pid %d) did not die", c.name, c.proc.pid)


def stop_servers(servers: list[Child], grace_s: float = 5.0) -> None:
    """Servers exit cleanly (final snapshot) on SIGTERM; SIGKILL whatever remains."""
    for c in servers:
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    kill_all(servers, grace_s=grace_s)


class Launcher:
    def __init__(
        self, cfg: RunConfig, *, report_dir: Path | None, run_dir: Path | None, progress: bool = True
    ) -> None:
        self.cfg = cfg
        self.report_dir = report_dir
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="flotilla-run-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.progress = progress
        self.children: list[Child] = []
        self._done_elapsed_s: float | None = None  # the job's wall time when it was done

    def run(self) -> RunResult:
        if self.cfg.strategy.kind == "pipeline":
            return self._run_pipeline()
        secret = generate_secret()
        secret_file = self.run_dir / "secret"
        write_secret_file(secret_file, secret)
        builders.build_dataset(self.cfg)  # generate/cache the data once, before workers start
        servers: list[Child] = []
        try:
            ps_addresses = self._start_servers(secret_file, servers) if self.cfg.strategy.kind == "ps" else []
        except BaseException:
            stop_servers(servers)
            raise
        coord = Coordinator(self.cfg, secret, report_dir=self.report_dir, ps_servers=ps_addresses).start()
        try:
            atomic_write_json(
                self.run_dir / "coordinator.json",
                {"address": coord.address, "secret_file": str(secret_file), "pid": os.getpid()},
            )
            for spec in self.cfg.cluster.resolved_workers():
                self._start_worker(coord.address, secret_file, spec.name)
            with Progress(enabled=self.progress, total_steps=self._total_steps()) as prog:
                code = self._supervise(coord, prog)
            summary = self._summarize(coord)
        except BaseException:
            coord.request_stop()
            raise
        finally:
            coord.request_stop()
            kill_all(self.children)
            stop_servers(servers)
            coord.close()
        return RunResult(
            summary=summary,
            run_dir=self.run_dir,
            exit_code=code,
            worker_exit_codes={c.name: c.proc.returncode for c in self.children},
        )

    def _start_servers(self, secret_file: Path, servers: list[Child]) -> list[str]:
        """One ``flotilla server`` process per shard; returns their addresses once all listen."""
        import yaml

        cfg_file = self.run_dir / "config.yaml"
        cfg_file.write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        num = self.cfg.strategy.num_servers
        snap_dir = self.run_dir / "ps-snapshots"
        stale = sorted(snap_dir.glob("*.snap")) if snap_dir.is_dir() else []
        for f in stale:  # a reused --run-dir: a new job must not resume an old one's shards
            f.unlink()
        if stale:
            log.warning(
                "removed %d parameter-server snapshot(s) of a previous job from %s", len(stale), snap_dir
            )
        for i in range(num):
            addr_file = self.run_dir / f"ps{i}.address"
            addr_file.unlink(missing_ok=True)  # never read a previous job's address
            cmd = [
                sys.executable,
                "-m",
                "flotilla.cli.main",
                "server",
                str(cfg_file),
                "--shard-index",
                str(i),
                "--secret-file",
                str(secret_file),
                "--address-file",
                str(addr_file),
                "--bind",
                f"tcp://{self.cfg.cluster.host}:0",
                "--snapshot-dir",
                str(self.run_dir / "ps-snapshots"),
                "--log-level",
                "WARNING",
            ]
            log_path = self.run_dir / f"ps{i}.log"
            servers.append(Child(name=f"ps{i}", proc=spawn(cmd, log_path), log_path=log_path))
        deadline = time.monotonic() + 60
        addresses: list[str] = []
        for i, child in enumerate(servers):
            addr_file = self.run_dir / f"ps{i}.address"
            while not addr_file.exists():
                if child.proc.poll() is not None or time.monotonic() > deadline:
                    tail = child.log_path.read_text(errors="replace").strip()[-500:]
                    raise FlotillaError(f"parameter server {i} did not start: {tail}")
                time.sleep(0.05)
            addresses.append(addr_file.read_text().strip())
        return addresses

    def _run_pipeline(self) -> RunResult:
        from flotilla.launch.pipeline import run_pipeline_job

        summary = run_pipeline_job(
            self.cfg,
            self.report_dir,
            self.run_dir,
            self.progress,
            spawn=spawn,
            kill_all=kill_all,
            make_progress=lambda on, n: Progress(enabled=on, total_steps=n),
        )
        return RunResult(
            summary=summary, run_dir=self.run_dir, exit_code=0 if summary.get("completed") else 1
        )

    def _total_steps(self) -> int:
        data = builders.build_dataset(self.cfg)
        return builders.total_steps(self.cfg, builders.build_sampler(self.cfg, data))

    def _start_worker(self, address: str, secret_file: Path, name: str) -> None:
        log_path = self.run_dir / f"{name}.log"
        proc = spawn(worker_command(address, secret_file, name), log_path)
        self.children.append(Child(name=name, proc=proc, log_path=log_path))

    def _supervise(self, coord: Coordinator, prog: Progress) -> int:
        while True:
            snap = coord.snapshot()
            prog.update(snap)
            self._reap(coord)
            alive = [c for c in self.children if c.proc.poll() is None]
            if snap["done"]:
                self._done_elapsed_s = snap["elapsed_s"]
                self._await_exits(coord, prog)
                return 0
            if not alive:
                return 0 if snap["done"] else 1
            time.sleep(0.2)

    def _await_exits(self, coord: Coordinator, prog: Progress, grace_s: float = 10.0) -> None:
        """The job is done: give the workers up to ``grace_s`` to leave and exit by themselves
        (they see "done" in their next heartbeat reply, within about a second), so that their
        last records (metrics, clocks) are in before the summary.  Workers the coordinator
        declared dead are not waited for; whoever is left afterwards is stopped by ``kill_all``."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self._reap(coord)
            snap = coord.snapshot()
            prog.update(snap)
            dead = {w["name"] for w in snap["workers"] if w["state"] == "dead"}
            if not any(c.proc.poll() is None and c.name not in dead for c in self.children):
                break
            time.sleep(0.05)
        self._reap(coord)
        coord.settle_clocks()

    def _reap(self, coord: Coordinator) -> None:
        for c in self.children:
            rc = c.proc.poll()
            if rc is None or c.exit_handled:
                continue
            c.exit_handled = True
            if rc == 0:
                coord.mark_left(c.name)
            else:
                tail = c.log_path.read_text(errors="replace").strip().splitlines()[-3:]
                log.warning("worker %s exited with code %d: %s", c.name, rc, " | ".join(tail))
                coord.remove_worker(c.name, f"process exited with code {rc}")

    def _summarize(self, coord: Coordinator) -> dict:
        coord.settle_clocks()
        snap = coord.snapshot()
        final = snap["final"]
        workers = snap["workers"]
        samples = sum(w["samples"] for w in workers)
        wall_s = self._done_elapsed_s if self._done_elapsed_s is not None else snap["elapsed_s"]
        return {
            "test_accuracy": final.get("test_accuracy"),
            "test_loss": final.get("test_loss"),
            "steps": final.get("steps", max((w["step"] for w in workers), default=0)),
            "wall_s": wall_s,
            "samples_per_s": samples / wall_s if wall_s > 0 else 0.0,
            "num_workers": len(snap["members"]),
            "num_workers_started": len(workers),
            "membership_epochs": snap["epoch"],
            "completed": bool(snap["done"]),
            "final_digest": final.get("digest"),
            "workers": [_worker_row(w) for w in workers],
            "evals": snap["evals"],
            "strategy": self.cfg.strategy.kind,
            **(
                {"max_clock_spread": snap["max_clock_spread"]}
                if snap.get("max_clock_spread") is not None
                else {}
            ),
        }


def _worker_row(w: dict) -> dict:
    """A worker's line of ``summary.json``: its mean throughput over the time it spent in steps
    (not the last step's), and its last clock under strategy ps."""
    row = {k: w[k] for k in ("name", "speed", "state", "step")}
    row["samples_per_s"] = w["samples"] / w["busy_s"] if w.get("busy_s") else 0.0
    if w.get("clock") is not None:
        row["clock"] = w["clock"]
    return row


def write_reports(report_dir: Path, summary: dict) -> list[Path]:
    from flotilla.report.metrics import make_plots, write_summary

    paths = [write_summary(report_dir, summary)]
    paths += make_plots(report_dir)
    return paths


def read_coordinator_file(run_dir: Path) -> dict:
    path = Path(run_dir) / "coordinator.json"
    if not path.exists():
        raise FlotillaError(f"{path} not found: is `flotilla run --run-dir {run_dir}` running?")
    return json.loads(path.read_text())
