"""A pipeline job whose stages are started on any host: ``flotilla coordinator`` for ``kind: pipeline``
and for a strategy run by the pipeline runner whose instances stand alone (``hetpipe``: its
``stages`` hook's host side -- the parameter-server shards -- is hosted here, beside the store, and
told of every lost instance; its placement decides the stage processes).

``run_hosted_pipeline(cfg, secret, port=..., report_dir=...)`` does what ``flotilla run`` does for
a pipeline (``launch/pipeline.py``: the same checks, profile, split and final report) except
start the stages: it hosts the job (``roles/stage_host.py``: the authenticated rendezvous store and
the message plane on ``cluster.host``) and waits for stage workers to join
(``flotilla worker --coordinator HOST:PORT``, ``roles/stage_worker.py``), each naming the stage
process it runs.  Every stage group forms once every process has joined; the stages report to the
host, which writes their files into its run directory; at the end the lead instance's weights are
merged into ``model.safetensors``, evaluated, and the summary written as ``flotilla run`` writes
it.

A stage is lost when its own error is reported, when its process dies (its liveness connection
to the host closes: seen at once), or when it goes silent for ``cluster.heartbeat_timeout_s``; a
neighbour whose group broke under it is not named when the cause is known within
``GROUP_GRACE_S``.  With ``strategy.replicas`` > 1 and another instance whole, the lost stage's
instance is dropped (``launch/pipeline_host_instances.py``: its other stages told to stop, the
survivors' next generation announced in the store; ``instances_lost`` and ``degraded`` in the
summary) and, for ``kind: pipeline``, comes back when workers take its stage processes again
(``instances_back``).  Nobody here can start a process on another host, so the job never
restarts: with no whole instance left, the stages still running are told to stop (within a
beat), ``summary.json`` says ``completed: false`` with the line naming the stage, and
:class:`FlotillaError` carries that line.  Checkpoints are written only with
``checkpoint.every_steps`` set, under ``checkpoint.dir`` on each stage's host;
``flotilla run --resume`` continues from them once they are gathered on one machine.  A strategy
whose checkpoints are its servers' snapshots on this host (``hetpipe``: with a ``checkpoint``
section) goes on from them here too: ``flotilla coordinator --resume DIR|auto``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from flotilla.comm import shaping
from flotilla.config import RunConfig
from flotilla.core.errors import ConfigError, FlotillaError
from flotilla.core.log import get_logger
from flotilla.launch.pipeline_attempt import GROUP_GRACE_S
from flotilla.launch.pipeline_finish import final_model, finish_pipeline
from flotilla.launch.pipeline_host_instances import HostedInstances
from flotilla.launch.pipeline_prepare import PreparedPipeline, host_context, prepare_pipeline
from flotilla.launch.pipeline_watch import Restarts, reached_step, snapshot, write_incomplete
from flotilla.launch.progress import Progress
from flotilla.report.summary import write_reports
from flotilla.roles.stage_host import StageHost
from flotilla.sync.stage_plug import HostSide, lost_instances_return, stage_plug
from flotilla.trainer.pipeline_job import StageJob
from flotilla.trainer.pipeline_setup import pipeline_strategy

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
    resume_dir: Path | None = None,
) -> dict[str, Any]:
    """Host the pipeline job until its stages finished (module doc); the summary.  ConfigError
    before anything listens when the job cannot run; FlotillaError when a stage failed.
    ``resume_dir``: a strategy whose checkpoints are its servers' snapshots (``hetpipe``) goes on
    from them, as under ``flotilla run --resume``."""
    with shaping.scoped(cfg.cluster.link_shaping("coordinator")):  # (its servers' links: links.emulate)
        return _run_hosted(cfg, secret, port, report_dir, run_dir, progress, on_listening, resume_dir)


def _run_hosted(
    cfg: RunConfig,
    secret: bytes,
    port: int,
    report_dir: Path | None,
    run_dir: Path | None,
    progress: bool,
    on_listening: Callable[[str], None] | None,
    resume_dir: Path | None = None,
) -> dict[str, Any]:
    plug = stage_plug(cfg)  # what the strategy adds (sync/stage_plug.py): e.g. hetpipe's servers
    if resume_dir is not None and (plug is None or not plug.keeps_checkpoints):
        raise ConfigError(f"--resume: strategy {cfg.strategy.kind} keeps no checkpoints on this host")
    if plug is not None and plug.reforms:  # (new stage processes on other devices: started here, nowhere)
        raise ConfigError(
            f"strategy.reform: `flotilla coordinator` cannot start stage processes on other devices "
            f"to form a lost {cfg.strategy.kind} instance again; run it with `flotilla run`, or set "
            "reform: false (a lost instance then comes back when its stages are started again)"
        )
    prep = prepare_pipeline(cfg, report_dir, run_dir, resume_dir, default_checkpoints=False)
    job = prep.job(cfg, None)
    if plug is not None and not plug.independent_instances:
        raise ConfigError(
            f"strategy.kind {cfg.strategy.kind!r} runs with `flotilla run` on one host for now, "
            "not with `flotilla coordinator`"
        )
    side = (
        plug.host(
            host_context(
                cfg, prep, prep.parts.model, secret, job.replicas, resume_dir, default_checkpoints=False
            )
        )
        if plug is not None
        else None
    )
    try:
        if side is not None:
            job = replace(job, services=side.services)
        host = StageHost(
            job, secret, host=cfg.cluster.host, port=port, heartbeat_timeout_s=cfg.cluster.heartbeat_timeout_s
        ).start()
    except BaseException:
        if side is not None:
            side.close()
        raise
    try:
        return _host(cfg, prep, job, host, secret, progress, on_listening, side)
    finally:
        if side is not None:
            side.close()


def _host(
    cfg: RunConfig,
    prep: PreparedPipeline,
    job: StageJob,
    host: StageHost,
    secret: bytes,
    progress: bool,
    on_listening: Callable[[str], None] | None,
    side: HostSide | None,
) -> dict[str, Any]:
    """:func:`run_hosted_pipeline` once its host listens (``side``: the strategy's launcher side)."""
    if on_listening is not None:
        on_listening(host.address)
    log.info("pipeline host on %s; stage processes: %s", host.address, host.claims.listing())
    start = time.perf_counter()
    # (instances that stand alone come back only where their strategy says so: hetpipe's VWs do)
    plug = stage_plug(cfg)
    bring_back = job.replicas > 1 and lost_instances_return(plug)
    alone = bring_back and plug is not None and plug.independent_instances  # (their state: the servers')
    timeout_s = pipeline_strategy(cfg).step_timeout_s
    instances = HostedInstances(host, secret, timeout_s, bring_back=bring_back, alone=alone)
    instances.on_lost = side.lost if side is not None else None
    try:
        try:
            with Progress(enabled=progress, total_steps=prep.num_steps) as display:
                stopped = _watch(host, cfg, prep.run_dir, display, start, instances)
            lead = instances.generation.instances[0]
            if stopped:  # (a non-finite value: the last finite weights are kept, the run is incomplete)
                out = prep.out_dir / "model.safetensors"
                state = side.final_state() if side is not None else None
                final_model(cfg, prep.parts, prep.run_dir, job, out, lead, state)
                raise FlotillaError(f"{stopped}; {out} holds them")
        except (FlotillaError, KeyboardInterrupt) as exc:
            why = str(exc) if isinstance(exc, FlotillaError) else "interrupted (Ctrl-C)"
            host.stop(why)
            _await_quiet(host)
            processes = len(job.stage_names)
            extra: dict = {"instances_lost": instances.lost}  # (those given up before it ended)
            if prep.placement is not None:
                extra["placement"] = prep.placement
            wall = time.perf_counter() - start
            write_incomplete(prep.report_dir, prep.run_dir, processes, Restarts(0), why, wall, extra)
            raise
        alive = instances.generation.instances  # (the lead first)
        summary = finish_pipeline(
            cfg, prep, prep.plan, host.job, time.perf_counter() - start, None, alive, side
        )
    finally:
        host.close()
    if prep.placement is not None:  # (the instances the strategy placed: VWs, devices, cuts)
        summary["placement"] = prep.placement
    lost, back = instances.lost, instances.returned
    summary.update(restarts=[], instances_lost=lost, instances_back=back, degraded=instances.note())
    summary["instances_regrouped"] = instances.regrouped  # (a group broke with every instance alive)
    summary["hosts"] = {host.claims.names[g]: c.host for g, c in sorted(host.claims.claims.items())}
    if prep.report_dir is not None:
        write_reports(prep.report_dir, summary)
    return summary


def _watch(
    host: StageHost,
    cfg: RunConfig,
    run_dir: Path,
    display: Progress,
    start: float,
    instances: HostedInstances,
) -> str:
    """Until every stage process of the live instances sent its result ("", or the line of a
    non-finite stop); a stage that failed or went silent loses its instance, or ends the job
    (FlotillaError) when no whole instance is left (module doc)."""
    workers = [cfg.cluster.worker(n) for n in host.job.stage_names]  # (process g: its stage<g> files)
    said, failed_at = 0.0, None
    while True:
        v = host.view(quiet_s=GROUP_GRACE_S)
        live = instances.processes()
        joining = instances.joining()  # (announced back, not in yet: they end with the others or never)
        # (every instance lost, their state held elsewhere -- hetpipe's servers --: no end, the job
        # waits for their stages to be started again, and for the first back to be in)
        trained = [g for g in live if g not in joining]
        if trained and all(g in v.results for g in trained):
            late = [g for g in instances.newcomers() + instances.drop_joining() if g in v.claimed]
            if late:  # (newcomers of an instance that did not come back in time)
                host.stop_processes(late, "the job completed before this stage's pipeline instance came back")
            return _stop_line(run_dir, instances.processes())
        lost: tuple[int, str] | None = None
        failures = {g: f for g, f in v.failures.items() if g in live}
        dead = [g for g in v.dead if g in live]
        task = next((g for g, (cause, _) in failures.items() if cause == "task"), None)
        if task is not None:  # (its task raised, job.on_error: stop: no instance comes back from that)
            raise FlotillaError(f"pipeline stage {host.describe(task)} failed: {failures[task][1]}")
        if failures:
            failed_at = failed_at if failed_at is not None else time.monotonic()
            own = [g for g, (cause, _) in failures.items() if cause != "group"]
            first = own[0] if own else next(iter(failures))  # (a group's failure: the cause is elsewhere)
            settled = all(g in failures or g in v.results for g in live if g in v.claimed)
            if own:
                lost = (first, f"pipeline stage {host.describe(first)} failed: {failures[first][1]}")
            elif dead:
                lost = (dead[0], f"pipeline stage {host.describe(dead[0])}: its process is gone")
            elif settled or time.monotonic() - failed_at > GROUP_GRACE_S:
                quiet = [g for g in v.quiet if g in live]
                broke = f"{host.describe(first)}: {failures[first][1]}"
                lost = (
                    (quiet[0], f"pipeline stage {host.describe(quiet[0])} stopped answering (its process "
                               f"or host is gone) and broke its stage group: {broke}")
                    if quiet
                    else (first, f"pipeline stage {host.describe(first)} failed: {failures[first][1]}")
                )  # fmt: skip
        if lost is None and dead:  # (its connection to the host closed without a goodbye)
            lost = (dead[0], f"pipeline stage {host.describe(dead[0])}: its process is gone")
        silent = [g for g in v.silent if g in live]
        if lost is None and silent:
            lost = (
                silent[0],
                f"pipeline stage {host.describe(silent[0])} went silent for more than "
                f"{cfg.cluster.heartbeat_timeout_s:g} s (cluster.heartbeat_timeout_s): its process or "
                "host is gone",
            )
        if lost is not None:
            if not instances.lose(*lost, reached_step(run_dir, len(workers))):
                raise FlotillaError(lost[1])
            failed_at = None
            continue
        instances.poll(v, reached_step(run_dir, len(workers)))
        if v.missing and time.monotonic() - said >= WAITING_LOG_S:
            log.info("waiting for stage workers: %s", ", ".join(host.describe(g) for g in v.missing))
            said = time.monotonic()
        display.update(snapshot(run_dir, workers, start, host.job.layout))
        time.sleep(0.2)


def _stop_line(run_dir: Path, processes: list[int]) -> str:
    """The line of a stage that stopped on a non-finite value ("" when none did): the stage
    nearest the loss knows most."""
    for g in reversed(processes):
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
