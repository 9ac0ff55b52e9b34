"""The ``flotilla`` command line.

``flotilla run CONFIG`` starts the embedded local cluster; ``flotilla coordinator`` and
``flotilla worker`` start one role each so a job can span machines; ``flotilla validate`` checks
a configuration.  Invalid configurations exit with status 2 and one line naming the field.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from flotilla.core.errors import ConfigError, FlotillaError
from flotilla.core.log import setup_logging

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="flotilla: training on heterogeneous, transient clusters.",
)


@app.callback()
def _importable_cwd() -> None:
    """Every command imports a task named ``"package.module:Class"`` from the current directory,
    as ``python -m`` (and so every child process of a run) does; the ``flotilla`` console script
    alone would not have the current directory on ``sys.path``."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


SetOpt = typer.Option(None, "--set", help="Override a config value: a.b.c=value (repeatable).")


def _load(config: Path, overrides: Optional[list[str]]):
    from flotilla.config import load_config

    try:
        return load_config(config, overrides or [])
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command()
def validate(config: Path, set_: Optional[list[str]] = SetOpt) -> None:
    """Check a configuration file (everything `flotilla run` checks of it before starting,
    the task included; not this machine's devices) and print it resolved."""
    import yaml

    from flotilla.launch.validation import validate as validate_config

    cfg = _load(config, set_)
    try:
        validate_config(cfg)  # the one validation `flotilla run` makes too (launch/validation.py)
    except FlotillaError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


@app.command()
def strategies(
    name: Optional[str] = typer.Argument(
        None, help="Also a kind given by import name, e.g. ./my_strategy.py:SPEC."
    ),
) -> None:
    """List the strategy kinds, what each is for and its settings (field = default)."""
    from flotilla.sync import registry

    try:
        found = [registry.spec_of(name)] if name else list(registry.specs())
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    for spec in found:
        typer.echo(f"{spec.kind}: {spec.summary}")
        for field, default in spec.fields().items():
            typer.echo(f"    {field} = {default}")


@app.command()
def run(
    config: Path,
    set_: Optional[list[str]] = SetOpt,
    report: Optional[Path] = typer.Option(None, help="Write metrics.jsonl, summary.json and plots here."),
    run_dir: Optional[Path] = typer.Option(None, help="Where logs, the secret file and coordinator.json go."),
    progress: bool = typer.Option(True, help="Show the live progress display."),
    log_level: str = typer.Option("WARNING", help="Log level of the launcher and coordinator."),
    resume: Optional[Path] = typer.Option(
        None,
        help="Continue from the newest complete checkpoint in this directory (and keep writing there); "
        "'auto': in the job's own checkpoint directory under --report (e.g. after the launcher died). "
        "Strategy ps: from its shards' snapshots (a report directory or its ps-snapshots), also on "
        "another number of shards.",
    ),
) -> None:
    """Run a job on the embedded local cluster: a coordinator and N worker processes."""
    from rich.console import Console

    from flotilla.cli.role_cmds import say_members_lost, stop_on_sigint
    from flotilla.launch.local import Launcher, write_reports
    from flotilla.launch.progress import summary_table

    setup_logging("launcher", log_level)
    stop_on_sigint()
    cfg = _load(config, set_)
    try:
        resume = _resume_dir(cfg, resume, report, run_dir)
        launcher = Launcher(cfg, report_dir=report, run_dir=run_dir, progress=progress, resume_dir=resume)
        result = launcher.run()
    except KeyboardInterrupt:
        typer.echo("interrupted: every process of the run has been stopped", err=True)
        raise typer.Exit(130) from None
    except FlotillaError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2 if isinstance(exc, ConfigError) else 1) from None
    Console(stderr=True).print(summary_table(result.summary))
    say_members_lost(result.summary)  # (an elastic run loses members on purpose: exit status unchanged)
    if report is not None:
        for path in write_reports(report, result.summary):
            typer.echo(f"wrote {path}", err=True)
    _where_it_went(result.summary, report, result.run_dir)
    if result.exit_code != 0 or not result.summary.get("completed"):
        reason = result.summary.get("error") or "the run did not complete (see the worker logs)"
        typer.echo(f"error: {reason}", err=True)
        raise typer.Exit(result.exit_code or 1)


def _resume_dir(
    cfg, resume: Optional[Path], report: Optional[Path], run_dir: Optional[Path]
) -> Optional[Path]:
    """``--resume DIR`` as given; ``--resume auto``: the job's newest checkpoints, found under
    the report (else run) directory (``launch.prepare.find_resume_dir``), and said."""
    from flotilla.launch.prepare import RESUME_AUTO, find_resume_dir

    if resume is None or str(resume) != RESUME_AUTO or resume.exists():
        return resume
    found = find_resume_dir(cfg, report if report is not None else run_dir)
    typer.echo(f"resuming from the checkpoints in {found.resolve()}", err=True)
    return found


def _where_it_went(summary: dict, report: Optional[Path], run_dir: Path) -> None:
    """The model file, the report and the logs, one line each (a run without ``--report``
    keeps its model in the run directory, a temporary one unless ``--run-dir`` named it)."""
    model_file = summary.get("model_file")
    if model_file and Path(model_file).is_file():
        typer.echo(f"model: {Path(model_file).resolve()}", err=True)
    if report is not None:
        typer.echo(f"report: {report.resolve()}", err=True)
    else:
        typer.echo("report: none written (pass --report DIR for summary.json, metrics and plots)", err=True)
    typer.echo(f"logs: {Path(run_dir).resolve()}", err=True)


def _exit_now(code: int) -> None:
    """Exit without the interpreter's finalisation: everything that matters (records, files,
    sockets, process groups) is flushed and closed by now, and finalising torch's object graph
    took ~5 s per worker process (measured: the launcher saw the exit 5 s after the worker's
    last log line), which delays the job's end and any survivor waiting for a death notice."""
    import logging

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


from flotilla.cli.calibrate_cmd import calibrate_command  # noqa: E402
from flotilla.cli.pipeline_cmds import plan_command, profile_command  # noqa: E402
from flotilla.cli.ps_cmd import server_command  # noqa: E402
from flotilla.cli.ps_replica_cmd import replica_command  # noqa: E402
from flotilla.cli.role_cmds import coordinator_command, worker_command  # noqa: E402
from flotilla.cli.simulate_cmd import simulate_command  # noqa: E402

app.command("profile", help="Profile a model layer by layer (JSON for the partitioner).")(profile_command)
app.command("plan", help="Partition the model over the cluster's devices and print the plan.")(plan_command)
app.command("server", help="Run one parameter-server shard (strategy ps).")(server_command)
app.command(
    "server-replica",
    help="Run the primary or the backup of a replicated parameter-server shard (strategy.replication: 2).",
)(replica_command)
app.command("simulate", help="Predict the job on a (larger) cluster and compare strategies.")(
    simulate_command
)
app.command("calibrate", help="Measure this machine's communication costs for the simulator.")(
    calibrate_command
)
app.command("coordinator")(coordinator_command)
app.command("worker")(worker_command)


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":
    sys.exit(app())
