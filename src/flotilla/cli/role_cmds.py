"""``flotilla coordinator`` and ``flotilla worker``: one role each, so a job can span machines.

- The coordinator binds ``cluster.host`` (``--host`` overrides it; ``0.0.0.0`` binds every
  interface and the workers use the address they dialled), logs the addresses it listens on,
  and when the job is over writes the same report as ``flotilla run`` (``--report``:
  ``summary.json`` with ``members_lost`` and ``degraded``, metrics, plots; an interrupted job's
  says ``completed: false``, ``interrupted``).  Exit status: 0 the job completed
  with every member, 3 it completed but lost members (each named on stderr, when and why),
  1 it failed or did not complete, 2 a configuration error.
- The worker finds its coordinator and name on the command line or in the environment its
  scheduler set (``cli/scheduler_env.py``: torchrun, SLURM, Kubernetes), and binds every plane
  on the address that reaches the coordinator (``comm/addresses.py``; ``--host`` or
  ``$FLOTILLA_HOST`` to choose one).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Optional

import typer

from flotilla.core.errors import EXIT_OUT_OF_MEMORY, ConfigError, FlotillaError, OutOfMemory
from flotilla.core.log import get_logger, setup_logging

__all__ = ["EXIT_MEMBERS_LOST", "coordinator_command", "say_members_lost", "worker_command"]

log = get_logger("cli")

EXIT_MEMBERS_LOST = 3
SetOpt = typer.Option(None, "--set", help="Override a config value: a.b.c=value (repeatable).")
HostOpt = typer.Option(
    None, "--host", help="Address of this machine to bind and advertise (default: the route to the cluster)."
)


def stop_on_sigint() -> None:
    """Ctrl-C (SIGINT) stops the run cleanly even when this process was started with SIGINT
    ignored (a background job of a script inherits that, and Python then leaves it ignored)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def coordinator_command(
    config: Path,
    set_: Optional[list[str]] = SetOpt,
    secret_file: Path = typer.Option(..., help="Per-cluster secret (created if missing)."),
    port: int = typer.Option(0, help="Message-plane port (0 = any free port)."),
    host: Optional[str] = typer.Option(None, help="Bind here, not cluster.host (0.0.0.0: every interface)."),
    ps_server: Optional[list[str]] = typer.Option(
        None, "--ps-server", help="HOST:PORT of a parameter-server shard, in shard order (repeatable)."
    ),
    report: Optional[Path] = typer.Option(None, help="Write summary.json, metrics and plots here."),
    resume: Optional[Path] = typer.Option(
        None,
        help="A job whose checkpoints are its servers' snapshots (hetpipe) goes on from them: a "
        "directory, or 'auto' (its own under --report).",
    ),
    log_level: str = typer.Option("INFO"),
) -> None:
    """Run the coordinator alone; workers join with `flotilla worker --coordinator HOST:PORT`."""
    from flotilla.cli.main import _load
    from flotilla.comm.auth import generate_secret, read_secret_file, write_secret_file
    from flotilla.config import PipelineStrategy
    from flotilla.roles.coordinator import Coordinator

    setup_logging("coordinator", log_level)
    stop_on_sigint()
    cfg = _load(config, [*(set_ or []), *([f"cluster.host={host}"] if host else [])])
    if not secret_file.exists():
        write_secret_file(secret_file, generate_secret())
    resume = _hosted_resume(cfg, resume, report)
    if isinstance(cfg.strategy, PipelineStrategy):  # the stages join it: launch/pipeline_host.py
        if ps_server:
            typer.echo("error: --ps-server: a pipeline job has no parameter servers", err=True)
            raise typer.Exit(2)
        raise typer.Exit(_host_pipeline(cfg, read_secret_file(secret_file), port, report, resume))
    files: dict[str, str | None] | None = {"output_dir": str(Path(report).resolve())} if report else None
    servers = [s if "://" in s else f"tcp://{s}" for s in ps_server or []]
    try:
        coord = Coordinator(
            cfg, read_secret_file(secret_file), port=port, report_dir=report, files=files, ps_servers=servers
        ).start()
    except (FlotillaError, OSError) as exc:
        typer.echo(f"error: coordinator: cannot listen on {cfg.cluster.host}:{port}: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"coordinator listening on {coord.address.removeprefix('tcp://')}", err=True)
    log.info(
        "addresses: message plane %s; rendezvous store and liveness listener on %s too",
        coord.address,
        cfg.cluster.host,
    )
    interrupted = False
    try:
        while not coord.snapshot()["done"]:
            time.sleep(0.2)
        _await_members(coord)
    except KeyboardInterrupt:
        interrupted = True
        coord.request_stop()
        time.sleep(1.0)
    try:
        code = _finish(coord, cfg.strategy.kind, report, interrupted)
    finally:
        coord.close()
    raise typer.Exit(code)


def _hosted_resume(cfg: Any, resume: Optional[Path], report: Optional[Path]) -> Optional[Path]:
    """``--resume`` of ``flotilla coordinator``: only for a job whose checkpoints are kept on this
    host (its servers' snapshots: ``hetpipe``); ``auto`` finds them under ``--report``.  Anything
    else is one line and exit status 2, before anything listens."""
    if resume is None:
        return None
    from flotilla.launch.prepare import RESUME_AUTO, find_resume_dir
    from flotilla.sync.stage_plug import stage_plug

    plug = stage_plug(cfg)
    if plug is None or not plug.keeps_checkpoints:
        typer.echo(
            f"error: --resume: strategy {cfg.strategy.kind} keeps no checkpoints on the coordinator's host; "
            "resume it with `flotilla run --resume` once its checkpoints are gathered on one machine",
            err=True,
        )
        raise typer.Exit(2)
    if str(resume) != RESUME_AUTO or resume.exists():
        return resume
    try:
        found = find_resume_dir(cfg, report)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"resuming from the snapshots in {found.resolve()}", err=True)
    return found


def _host_pipeline(cfg: Any, secret: bytes, port: int, report: Optional[Path], resume: Optional[Path]) -> int:
    """``flotilla coordinator`` for a pipeline job: host it until its stages finished; the exit
    status (0 completed, 1 failed, 2 configuration error, 130 interrupted)."""
    from flotilla.launch.pipeline_host import run_hosted_pipeline

    def listening(address: str) -> None:
        typer.echo(f"coordinator listening on {address.removeprefix('tcp://')}", err=True)

    try:
        summary = run_hosted_pipeline(
            cfg, secret, port=port, report_dir=report, resume_dir=resume, on_listening=listening
        )
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        return 2
    except FlotillaError as exc:
        typer.echo(f"error: {exc}", err=True)
        return 1
    except KeyboardInterrupt:
        typer.echo("error: interrupted (Ctrl-C)", err=True)
        return 130
    final = summary["evals"][-1] if summary.get("evals") else {}
    typer.echo(f"job finished: {final}", err=True)
    return 0


def _await_members(coord: Any, grace_s: float = 10.0) -> None:
    """The job is done: let the workers see it and send their last records (a worker leaves
    within about a second); a dead or suspected one is not waited for."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        states = {w["state"] for w in coord.snapshot()["workers"]}
        if states <= {"left", "done", "dead", "suspected"}:
            return
        time.sleep(0.1)


def _finish(coord: Any, strategy: str, report: Optional[Path], interrupted: bool) -> int:
    from flotilla.report.summary import final_summary, write_reports

    coord.settle_clocks()
    snap = coord.snapshot()
    summary = final_summary(snap, strategy=strategy)
    if interrupted:  # (as flotilla run's: an interrupted job's summary says so, never completed)
        summary.update(completed=False, interrupted=True, error=snap.get("error") or "interrupted (Ctrl-C)")
    if report is not None:
        for path in write_reports(report, summary):
            typer.echo(f"wrote {path}", err=True)
    say_members_lost(summary)
    final = snap["final"]
    if interrupted or not summary["completed"] or summary.get("error"):
        typer.echo(f"error: {summary.get('error') or 'the job did not complete'}", err=True)
        return 130 if interrupted else 1
    if summary["members_lost"]:
        n, lost = len(summary["workers"]), len(summary["members_lost"])
        typer.echo(f"job finished with {n - lost} of {n} members ({lost} lost): {final}", err=True)
        return EXIT_MEMBERS_LOST
    typer.echo(f"job finished: {final}", err=True)
    return 0


def say_members_lost(summary: dict[str, Any]) -> None:
    """One ``member lost:`` line per worker the job went on without (``members_lost``)."""
    for m in summary.get("members_lost", ()):
        who = f"{m['name']} (worker {m['worker_id']})"
        back = ""
        if m.get("rejoined_as") is not None:
            back = f"; it came back as worker {m['rejoined_as']} at {m['rejoined_at_s']:.1f} s"
        typer.echo(f"member lost: {who} at {m['at_s']:.1f} s: {m['why']}{back}", err=True)


def worker_command(
    coordinator: Optional[str] = typer.Option(
        None, help="HOST:PORT of the coordinator (default: from the scheduler's environment)."
    ),
    coordinator_file: Optional[Path] = typer.Option(
        None,
        help="Instead of --coordinator: wait for this coordinator.json (`flotilla run` writes it "
        "once the job passed its checks) and join the coordinator it names; the worker imports "
        "torch meanwhile.",
    ),
    secret_file: Path = typer.Option(..., help="File holding the per-cluster secret."),
    name: Optional[str] = typer.Option(None, help="Worker name (matches cluster.workers[].name)."),
    stage: Optional[int] = typer.Option(
        None, "--stage", help="Pipeline jobs: the stage index this worker runs (instead of, or with, --name)."
    ),
    instance: Optional[int] = typer.Option(
        None,
        "--instance",
        help="Pipeline jobs with strategy.replicas > 1: the instance (default 0).",
    ),
    speed: Optional[float] = typer.Option(None, help="Override the speed factor."),
    host: Optional[str] = HostOpt,
    log_level: str = typer.Option("INFO"),
) -> None:
    """Run one worker process that joins a coordinator: a replica (any data-parallel strategy) or a
    pipeline stage (a pipeline job: by --name, or --stage and --instance)."""
    from flotilla.cli.main import _exit_now
    from flotilla.cli.scheduler_env import coordinator_from_env, name_from_env
    from flotilla.comm.addresses import set_local_host
    from flotilla.comm.auth import read_secret_file
    from flotilla.core.faults import FaultPlan
    from flotilla.roles.link import describe_coordinator
    from flotilla.roles.worker import WorkerOptions, run_worker

    try:
        found = None if coordinator or coordinator_file else coordinator_from_env(os.environ)
        named = None if name else name_from_env(os.environ)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    name = name or (named[0] if named else None)
    setup_logging(f"worker {name or os.getpid()}", log_level)
    if found is not None:
        coordinator = found[0]
        log.info("coordinator %s from %s", coordinator, found[1])
    if named is not None:
        log.info("name %s from %s", name, named[1])
    if (coordinator is None) == (coordinator_file is None):
        typer.echo(
            "error: give one of --coordinator HOST:PORT and --coordinator-file PATH "
            "(or run under torchrun, SLURM or with FLOTILLA_COORDINATOR set: docs/multihost.md)",
            err=True,
        )
        raise typer.Exit(2)
    try:
        set_local_host(host or os.environ.get("FLOTILLA_HOST") or None)
        if coordinator_file is not None:
            from flotilla.launch.coordinator_file import await_coordinator_file
            from flotilla.trainer.optim import warm_imports

            warm_imports()  # while the launcher checks the job
            coordinator = str(await_coordinator_file(coordinator_file)["address"])
        assert coordinator is not None
        address = coordinator if "://" in coordinator else f"tcp://{coordinator}"
        secret = read_secret_file(secret_file)
        faults = FaultPlan.from_env(os.environ)  # tests hand a fault plan to the worker processes
        if describe_coordinator(address, secret).get("role") == "stage":  # (a pipeline job's host)
            from flotilla.roles.stage_worker import run_stage_worker

            _exit_now(
                run_stage_worker(address, secret, name=name, stage=stage, instance=instance, faults=faults)
            )
        if stage is not None or instance is not None:
            raise ConfigError(
                f"--stage and --instance are for pipeline jobs; the job at {coordinator} is not one"
            )
        opts = WorkerOptions(coordinator=address, secret=secret, name=name, speed=speed, faults=faults)
        code = run_worker(opts)  # (an evicted session is followed by a fresh one: cluster/rejoin.py)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except OutOfMemory as exc:  # (the launcher stops the job on this exit code)
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_OUT_OF_MEMORY) from None
    except FlotillaError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    _exit_now(code)
