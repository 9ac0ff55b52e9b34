"""``flotilla run``: the embedded local cluster (one coordinator in-process, N worker processes).

Guarantees
- The per-cluster secret is generated here, written to ``<run_dir>/secret`` (mode 0600, in a run
  directory made 0700) and handed to workers by file path, never on a command line; it is removed
  when the run ends (success, failure or Ctrl-C; the logs stay).
- Every child (worker, parameter server, pipeline stage) is started, watched and stopped by one
  ``flotilla.launch.supervisor.Supervisor``: its own session, killed if this process dies
  (PR_SET_PDEATHSIG on Linux), and on success, on failure and on Ctrl-C every child is killed and
  reaped before ``Launcher.run`` returns: no process is left behind.
- A worker that dies unexpectedly is removed from the membership (survivors continue); the run
  fails only if no worker is left.  A parameter-server shard that dies is restarted at the same
  address from its newest snapshot (``launch/ps_shards.py``, snapshots on by default).
- what to start comes from the pure launch plan (``cluster/launch_plan.py``, ``cfg.launch_plan()``):
  a pipeline runs through ``flotilla.launch.pipeline`` with the same supervisor.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from flotilla.cluster.launch_plan import Runner
from flotilla.comm.auth import generate_secret, write_secret_file
from flotilla.config import RunConfig
from flotilla.config.schema import CheckpointConfig
from flotilla.core.atomic_io import atomic_write_json
from flotilla.core.errors import EXIT_OUT_OF_MEMORY, FlotillaError
from flotilla.core.log import get_logger
from flotilla.launch import ps_resume, validation
from flotilla.launch.coordinator_file import FILE_NAME, read_coordinator_file
from flotilla.launch.progress import Progress
from flotilla.launch.ps_shards import ShardSupervisor, with_default_snapshots
from flotilla.launch.revocations import RevocationDriver, start_revocations
from flotilla.launch.supervisor import Child, Supervisor, error_line, exit_cause
from flotilla.launch.zygote_client import fork_allowed
from flotilla.report.summary import final_summary, write_reports

if TYPE_CHECKING:
    from flotilla.roles.coordinator import Coordinator

__all__ = ["Launcher", "RunResult", "read_coordinator_file", "worker_command", "write_reports"]

PROGRESS_INTERVAL_S = 0.2
DEFAULT_CHECKPOINT_EVERY_S = (
    10.0  # allreduce's default checkpoints (job.auto_checkpoint): docs/checkpoints.md
)
DEFAULT_CHECKPOINT_KEEP = 2

log = get_logger("launcher")


@dataclass(slots=True)
class RunResult:
    summary: dict
    run_dir: Path
    exit_code: int
    worker_exit_codes: dict[str, int] = field(default_factory=dict)


def worker_command(coordinator_file: Path, secret_file: Path, name: str) -> list[str]:
    """A worker that imports what it needs, then waits for ``coordinator_file`` and joins."""
    return [
        sys.executable,
        "-m",
        "flotilla.cli.main",
        "worker",
        "--coordinator-file",
        str(coordinator_file),
        "--secret-file",
        str(secret_file),
        "--name",
        name,
    ]


def with_default_checkpoints(cfg: RunConfig) -> tuple[RunConfig, bool]:
    """``cfg`` with the default checkpoints of a job whose strategy asks for them
    (``LaunchNeeds.auto_checkpoint``: ``allreduce``) that has no ``checkpoint`` section and
    ``job.auto_checkpoint`` on (every 10 s into ``<report>/checkpoints``, the 2 newest kept), and
    whether they were added.  Pipelines add theirs in ``launch/pipeline.py``; ``ps`` keeps its
    durable state in the servers' snapshots."""
    auto = cfg.strategy_spec.launch.auto_checkpoint
    if cfg.checkpoint is not None or not cfg.job.auto_checkpoint or not auto:
        return cfg, False
    default = CheckpointConfig(every_s=DEFAULT_CHECKPOINT_EVERY_S, keep=DEFAULT_CHECKPOINT_KEEP)
    return cfg.model_copy(update={"checkpoint": default}), True


def local_compute_procs(cfg: RunConfig) -> int:
    """The compute processes ``flotilla run`` starts on this machine: one per worker (or pipeline
    stage) and, for strategy ps, one per server shard; their intra-op threads share the cores."""
    return cfg.launch_plan().local_compute_procs


class Launcher:
    """Runs one job on this machine: the coordinator in-process, every role in a child process."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        report_dir: Path | None,
        run_dir: Path | None,
        progress: bool = True,
        resume_dir: Path | None = None,
    ) -> None:
        self.cfg, self._default_checkpoints = with_default_checkpoints(with_default_snapshots(cfg))
        self.report_dir = report_dir
        self.resume_dir = resume_dir
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="flotilla-run-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.run_dir, 0o700)  # it holds the cluster secret (removed when the run ends)
        self.progress = progress
        self.plan = cfg.launch_plan(resume=resume_dir is not None)  # the processes to start
        self.supervisor = Supervisor(
            self.run_dir, local_procs=self.plan.local_compute_procs, fork=fork_allowed(cfg)
        )
        self._done_elapsed_s: float | None = None  # the job's wall time when it was done
        self._coord: Coordinator | None = None
        self._revocations: RevocationDriver | None = None
        self._fatal = ""  # a worker ran out of memory: why the job stopped
        self._secret_file = self.run_dir / "secret"  # (written by run(); workers read it)
        self._shards: ShardSupervisor | None = None  # strategy ps: the shards' supervisor
        self._snapshot_dir = (self.report_dir or self.run_dir) / "ps-snapshots"  # (strategy ps)
        self._ps_resume: ps_resume.PSResume | None = None  # strategy ps --resume: what it resumed

    def run(self) -> RunResult:
        """Run the job; the secret file is removed when it ends, however it ends (the logs stay)."""
        try:
            return self._run()
        finally:
            self._secret_file.unlink(missing_ok=True)
            self.supervisor.close()  # (also where the run stopped before starting anything)

    def _run(self) -> RunResult:
        validation.validate_plan(self.cfg, resume=self.resume_dir is not None)  # nothing started yet
        if self.plan.num_servers and self.resume_dir is not None:
            ps_resume.require_snapshots(self.resume_dir)  # (checked in full once the task is built)
        if self.plan.runner is Runner.PIPELINE:
            return self._run_pipeline()
        secret = generate_secret()
        secret_file = self._secret_file
        write_secret_file(secret_file, secret)
        (self.run_dir / FILE_NAME).unlink(missing_ok=True)  # (a reused --run-dir: not the old one's)
        with self.supervisor as sup:  # leaving the block kills and reaps whatever still runs
            # The workers import torch while the job is checked here; they wait for
            # coordinator.json, which exists only once the check passed and the coordinator
            # listens.  An unusable job: one line, and the waiting workers are killed unseen.
            self._spawn_workers()
            # torch is imported from here on (the check, the coordinator's store), not before
            from flotilla.launch import prepare
            from flotilla.roles.coordinator import Coordinator

            self._steps = validation.validate_task(self.cfg)  # the rest of `flotilla validate`
            for warning in validation.check_host(self.cfg):
                log.warning(warning)
            if self.plan.num_servers and self.resume_dir is not None:  # (its state: the shards')
                self._ps_resume = ps_resume.prepare(
                    self.cfg, self.resume_dir, self._snapshot_dir, self._steps
                )
            files = prepare.job_files(
                self.cfg,
                output_dir=self.report_dir or self.run_dir,
                resume_dir=None if self.plan.num_servers else self.resume_dir,
                total_steps=self._steps,
                default_checkpoints=self._default_checkpoints,
            )
            try:
                ps_addresses = self._start_servers(secret_file) if self.plan.num_servers else []
            except BaseException:
                self._stop_servers()
                raise
            coord = Coordinator(
                self.cfg, secret, report_dir=self.report_dir, ps_servers=ps_addresses, files=files
            ).start()
            try:
                code, summary = self._train(coord, secret_file)
            finally:
                coord.request_stop()
                sup.stop("worker", grace_s=3.0)
                self._stop_servers()
                coord.close()
        if self._shards is not None:  # (after the final snapshots: what the shards went through)
            summary.update(self._shards.report())
        if self._ps_resume is not None:
            r = self._ps_resume
            summary["resumed"] = {"from": str(r.source), "num_shards": r.num_shards, "clock": r.resume_at}
        if self._fatal:  # (a worker ran out of memory: the summary says so, the run fails)
            summary.update(completed=False, error=self._fatal)
            if self.report_dir is not None:
                write_reports(Path(self.report_dir), summary)
            raise FlotillaError(self._fatal)
        codes = sup.exit_codes("worker")
        return RunResult(
            summary=summary,
            run_dir=self.run_dir,
            exit_code=code,
            worker_exit_codes={k: v for k, v in codes.items() if v is not None},
        )

    def _spawn_workers(self) -> None:
        for spec in self.cfg.cluster.resolved_workers():
            self._spawn_worker(spec.name)

    def _spawn_worker(self, name: str) -> Child:
        return self.supervisor.spawn(
            name,
            worker_command(self.run_dir / FILE_NAME, self._secret_file, name),
            role="worker",
            on_exit=lambda child, rc: self._worker_exited(child, rc),
        )

    def _train(self, coord: Coordinator, secret_file: Path) -> tuple[int, dict]:
        self._coord = coord  # (exits are reaped, and reported to it, from here on)
        atomic_write_json(
            self.run_dir / FILE_NAME,
            {"address": coord.address, "secret_file": str(secret_file), "pid": os.getpid()},
        )
        self._revocations = start_revocations(
            self.cfg,
            coord,
            supervisor=self.supervisor,
            spawn_worker=self._spawn_worker,
            steps=self._steps,
            log_path=(self.report_dir or self.run_dir) / "revocations.jsonl",
        )
        try:
            with Progress(enabled=self.progress, total_steps=self._steps) as prog:
                code = self._supervise(coord, prog)
        except KeyboardInterrupt:
            coord.request_stop()  # (first: the workers would train on while the report is written)
            self._write_incomplete(coord, "interrupted (Ctrl-C)")
            raise
        finally:
            if self._revocations is not None:
                self._revocations.close()
        return code, self._summarize(coord)

    def _start_servers(self, secret_file: Path) -> list[str]:
        """The job's shards (``launch/ps_shards.py``): started, watched, restarted when they die."""
        self._shards = ShardSupervisor(
            self.cfg,
            self.supervisor,
            run_dir=self.run_dir,
            snapshot_dir=self._snapshot_dir,
            secret_file=secret_file,
            num_shards=self.plan.num_servers,
            resumed=self._ps_resume is not None,
        )
        return self._shards.start()

    def _stop_servers(self) -> None:
        if self._shards is not None:
            self._shards.stop()  # no more restarts; SIGTERM: servers snapshot on it

    def _run_pipeline(self) -> RunResult:
        from flotilla.launch import prepare
        from flotilla.launch.pipeline import run_pipeline_job

        self._steps = validation.validate_task(self.cfg)  # one line, nothing started, if unusable
        for warning in validation.check_host(self.cfg):
            log.warning(warning)
        if self.resume_dir is not None:  # changed settings named before the stages' own checks
            for stage_dir in sorted(Path(self.resume_dir).glob("stage*")):
                prepare.refuse_changed_config(stage_dir, self.cfg, shown=Path(self.resume_dir))
        with self.supervisor as sup:
            summary = run_pipeline_job(
                self.cfg,
                self.report_dir,
                self.run_dir,
                self.progress,
                supervisor=sup,
                resume_dir=self.resume_dir,
            )
        return RunResult(
            summary=summary, run_dir=self.run_dir, exit_code=0 if summary.get("completed") else 1
        )

    def _supervise(self, coord: Coordinator, prog: Progress) -> int:
        """Until the job is done or no worker is left: the progress display every 0.2 s, and a
        child's exit handled as soon as the kernel reports it (``Supervisor.wait_exit``): a dead
        worker's notice is on the survivors' recovery path (the coordinator forms the next view
        once every member is accounted for)."""
        while True:
            snap = coord.snapshot()
            prog.update(snap)
            deadline = time.monotonic() + PROGRESS_INTERVAL_S
            while (left := deadline - time.monotonic()) > 0:
                self.supervisor.wait_exit(left)
                if self.supervisor.reap():
                    break
            alive = self.supervisor.alive("worker")
            if not alive:  # they may have finished (and exited) since the snapshot: look again
                snap = coord.snapshot()
            if snap["done"]:
                self._done_elapsed_s = snap["elapsed_s"]
                self._await_exits(coord, prog)
                return 0
            # (no worker left: over, unless the schedule adds one to a job that still admits joins)
            adds = self._revocations is not None and self._revocations.adds_pending()
            if not alive and (snap["stop"] or not adds):
                return 1

    def _await_exits(self, coord: Coordinator, prog: Progress, grace_s: float = 10.0) -> None:
        """The job is done: give the workers up to ``grace_s`` to leave and exit by themselves
        (they see "done" in their next heartbeat reply, within about a second), so that their
        last records (metrics, clocks) are in before the summary.  Workers the coordinator
        declared dead are not waited for; whoever is left afterwards is stopped by the supervisor."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self.supervisor.reap()
            snap = coord.snapshot()
            prog.update(snap)
            dead = {w["name"] for w in snap["workers"] if w["state"] == "dead"}
            if not any(c.name not in dead for c in self.supervisor.alive("worker")):
                break
            time.sleep(0.05)
        self.supervisor.reap()
        coord.settle_clocks()

    def _worker_exited(self, child: Child, rc: int) -> None:
        """A worker process ended: a clean exit is a leave, any other a failure -- except one the
        revocation schedule caused, which nobody is told about (the survivors find out)."""
        coord = self._coord
        if coord is None:  # (before the coordinator existed: the job never started)
            return
        if self._revocations is not None and self._revocations.revoked(child):
            log.info("worker %s revoked (exit code %d): no death notice", child.name, rc)
            return
        if rc == 0:
            coord.mark_left(child.name)
        elif rc == EXIT_OUT_OF_MEMORY:  # not transient: the job stops (docs/gpu.md)
            self._fatal = self._fatal or error_line(child, f"worker {child.name} ran out of memory")
            log.error("%s: the job stops", self._fatal)
            coord.remove_worker(child.name, "out of memory")
            coord.request_stop()
        else:
            log.warning("worker %s exited with code %d: %s", child.name, rc, child.log_tail())
            why = f"process exited with code {rc}"
            cause = exit_cause(child)  # (the user's exception, say: the job's last line names it)
            coord.remove_worker(child.name, f"{why}: {cause}" if cause else why)

    def _write_incomplete(self, coord: Coordinator, why: str) -> None:
        """An interrupted run still leaves its summary, marked ``completed: false`` and
        ``interrupted``, in the report directory (never masking the interruption)."""
        if self.report_dir is None:
            return
        try:
            summary = self._summarize(coord)
            summary.update(completed=False, interrupted=True, error=why)
            write_reports(Path(self.report_dir), summary)
        except Exception as exc:  # (the interruption is what the caller must see)
            log.warning("could not write the interrupted run's summary: %s", exc)

    def _summarize(self, coord: Coordinator) -> dict:
        coord.settle_clocks()
        snap = coord.snapshot()
        return final_summary(snap, strategy=self.cfg.strategy.kind, wall_s=self._done_elapsed_s)
