"""A pipeline job whose stages are started on any host: ``flotilla coordinator`` for ``kind: pipeline``.

``run_hosted_pipeline(cfg, secret, port=..., report_dir=...)`` does what ``flotilla run`` does for
a pipeline (``launch/pipeline.py``: the same checks, profile, split and final report) except
start the stages: it hosts the job (``roles/stage_host.py``: the authenticated rendezvous store and
the message plane on ``cluster.host``) and waits for stage workers to join
(``flotilla worker --coordinator HOST:PORT``, ``roles/stage_worker.py``), each naming the stage
process it runs.  Every stage group forms once every process has joined; the stages report to the
host, which writes their files into its run directory; at the end the lead instance's weights are
merged into ``model.safetensors``, evaluated, and the summary written as ``flotilla run`` writes
it.

Nobody here can restart a stage on another host, so a stage that fails (its own error; a
neighbour whose group broke under it is not named when the cause is known within
``GROUP_GRACE_S``) or goes silent for ``cluster.heartbeat_timeout_s`` ends the job: the stages
still running are told to stop (within a beat), ``summary.json`` says ``completed: false`` with
the line naming the stage, and :class:`FlotillaError` carries that line.  Checkpoints are
written only with ``checkpoint.every_steps`` set, under ``checkpoint.dir`` on each stage's host;
``flotilla run --resume`` continues from them once they are gathered on one machine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flotilla.config import RunConfig
from flotilla.core.errors import FlotillaError
from flotilla.core.log import get_logger
from flotilla.launch.pipeline import _final_model, finish_pipeline, job_file, prepare_pipeline
from flotilla.launch.pipeline_attempt import GROUP_GRACE_S
from flotilla.launch.pipeline_watch import Restarts, snapshot, write_incomplete
from flotilla.launch.progress import Progress
from flotilla.report.summary import write_reports
from flotilla.roles.stage_host import StageHost

__all__ = ["run_hosted_pipeline"]

log = get_logger("pipeline-host")

WAITING_LOG_S = 10.0  # while stages are missing: a line naming them this often
QUIET_S = 1.5  # after a stop: the stages still beating have heard it once none beat for this long


def run_hosted_pipeline(
    cfg: RunConfig,
    secret: bytes,
    *,
    port: int = 0,
    report_dir: Path | None = None,
    run_dir: Path | None = None,
    progress: bool = False,
    on_listening: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Host the pipeline job until its stages finished (module doc); the summary.  ConfigError
    before anything listens when the job cannot run; FlotillaError when a stage failed."""
    prep = prepare_pipeline(cfg, report_dir, run_dir, default_checkpoints=False)
    job = job_file(cfg, prep.plan, prep.num_steps, prep.run_dir, prep.report_dir, None, prep.ck_plan)
    host = StageHost(
        job, secret, host=cfg.cluster.host, port=port, heartbeat_timeout_s=cfg.cluster.heartbeat_timeout_s
    ).start()
    if on_listening is not None:
        on_listening(host.address)
    log.info("pipeline host on %s; stage processes: %s", host.address, host.claims.listing())
    start = time.perf_counter()
    try:
        try:
            with Progress(enabled=progress, total_steps=prep.num_steps) as display:
                stopped = _watch(host, cfg, prep.run_dir, display, start)
            if stopped:  # (a non-finite value: the last finite weights are kept, the run is incomplete)
                out = prep.out_dir / "model.safetensors"
                _final_model(cfg, prep.parts, prep.run_dir, list(job.layer_ends), out, 0)
                raise FlotillaError(f"{stopped}; {out} holds them")
        except (FlotillaError, KeyboardInterrupt) as exc:
            why = str(exc) if isinstance(exc, FlotillaError) else "interrupted (Ctrl-C)"
            host.stop(why)
            _await_quiet(host)
            processes = len(job.stage_names)
            write_incomplete(
                prep.report_dir, prep.run_dir, processes, Restarts(0), why, time.perf_counter() - start
            )
            raise
        summary = finish_pipeline(
            cfg, prep, prep.plan, host.job, time.perf_counter() - start, None, tuple(range(job.replicas))
        )
    finally:
        host.close()
    summary.update(restarts=[], instances_lost=[], instances_back=[], degraded=None)
    summary["hosts"] = {host.claims.names[g]: c.host for g, c in sorted(host.claims.claims.items())}
    if prep.report_dir is not None:
        write_reports(prep.report_dir, summary)
    return summary


def _watch(host: StageHost, cfg: RunConfig, run_dir: Path, display: Progress, start: float) -> str:
    """Until every stage process sent its result ("", or the line of a non-finite stop);
    FlotillaError when a stage failed or went silent (module doc)."""
    workers = cfg.cluster.resolved_workers()
    n = len(workers)
    said, failed_at = 0.0, None
    while True:
        v = host.view(quiet_s=GROUP_GRACE_S)
        if len(v.results) == n:
            return _stop_line(run_dir, n)
        if v.failures:
            failed_at = failed_at if failed_at is not None else time.monotonic()
            own = [g for g, (cause, _) in v.failures.items() if cause == "own"]
            if own:
                raise FlotillaError(f"pipeline stage {host.describe(own[0])} failed: {v.failures[own[0]][1]}")
            first = next(iter(v.failures))  # (its stage group broke under it: the cause is elsewhere)
            settled = len(v.failures) + len(v.results) >= len(v.claimed)
            if settled or time.monotonic() - failed_at > GROUP_GRACE_S:
                if v.quiet:  # a stage that stopped beating: its process or host is gone
                    broke = f"{host.describe(first)}: {v.failures[first][1]}"
                    raise FlotillaError(
                        f"pipeline stage {host.describe(v.quiet[0])} stopped answering (its process or "
                        f"host is gone) and broke its stage group: {broke}"
                    )
                raise FlotillaError(f"pipeline stage {host.describe(first)} failed: {v.failures[first][1]}")
        if v.silent:
            raise FlotillaError(
                f"pipeline stage {host.describe(v.silent[0])} went silent for more than "
                f"{cfg.cluster.heartbeat_timeout_s:g} s (cluster.heartbeat_timeout_s): its process or "
                "host is gone"
            )
        if v.missing and time.monotonic() - said >= WAITING_LOG_S:
            log.info("waiting for stage workers: %s", ", ".join(host.describe(g) for g in v.missing))
            said = time.monotonic()
        display.update(snapshot(run_dir, workers, start))
        time.sleep(0.2)


def _stop_line(run_dir: Path, n: int) -> str:
    """The line of a stage that stopped on a non-finite value ("" when none did): the stage
    nearest the loss knows most."""
    for g in reversed(range(n)):
        try:
            st = json.loads((run_dir / f"stage{g}.status.json").read_text())
        except (OSError, ValueError):
            continue
        if st.get("state") == "nonfinite":
            return str(st.get("message") or f"stage process {g} stopped on a non-finite value")
    return ""


def _await_quiet(host: StageHost, max_s: float = 5.0) -> None:
    """After a stop: until no stage has beaten for ``QUIET_S`` (each heard the stop), at most ``max_s``."""
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        if not host.beating_within(QUIET_S):
            return
        time.sleep(0.1)
