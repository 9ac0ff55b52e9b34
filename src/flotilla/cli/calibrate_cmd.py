"""``flotilla calibrate``: measure this machine for the simulator (``launch/calibrate.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from flotilla.core.errors import CollectiveError

__all__ = ["calibrate_command"]


def calibrate_command(
    out: Path = typer.Option(Path("calibration.json"), "--out", help="Where the profile goes."),
    world_size: int = typer.Option(2, "--world-size", help="Processes in the measured group (2-16)."),
    repeats: int = typer.Option(20, "--repeats", help="Timed repetitions per size (median)."),
    sizes: Optional[str] = typer.Option(None, "--sizes", help="Comma-separated message sizes in bytes."),
) -> None:
    """Measure this machine's all-reduce, point-to-point and per-step host costs for
    `flotilla simulate --calibration`."""
    from flotilla.launch.calibrate import calibrate

    try:
        parsed = [int(s) for s in sizes.split(",") if s.strip()] if sizes else None
    except ValueError:
        typer.echo(f"error: --sizes: comma-separated byte counts, got {sizes!r}", err=True)
        raise typer.Exit(2) from None
    try:
        calibrate(out, world_size=world_size, sizes=parsed, repeats=repeats, say=typer.echo)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except CollectiveError as exc:
        typer.echo(f"error: the measurement failed: {exc}", err=True)
        raise typer.Exit(1) from None
