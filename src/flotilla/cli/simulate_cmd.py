"""``flotilla simulate CONFIG``: predict a job on a (larger) cluster and compare strategies (SPEC §9,
``docs/simulator.md``).

``CONFIG`` is a training config (``flotilla run``'s: its job is measured on this machine) or a
sizing file (a top-level ``simulate:`` section: catalogued accelerators and a model shape); see
``cli/simulate_inputs.py``.  The command:

1. builds the job and the cluster (``--num-workers`` scales every device class to that total;
   ``--price TYPE=USD`` per device-hour);
2. replays the spot trace (``--trace``, or the file's) onto groups of devices with the runtime's
   replay rule (``sim/trace.py``);
3. simulates each strategy (``--strategies``, default: the file's) through its spec's
   ``simulated`` hook -- a kind without one is listed as not simulated -- printing each row as it
   finishes, then which finished first and which cost least; ``--json`` writes the comparison and
   ``--plots DIR`` the throughput and membership plots (``report/sim_plots.py``).

Errors are one line (``error: ...``) and exit status 2, naming the option or field.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Optional

import typer

from flotilla.core.errors import ConfigError, FlotillaError

__all__ = ["simulate_command"]


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def _strategies(entries: list[Any], names: str | None) -> list[tuple[str, Any]]:
    """(label, simulated strategy or None) for each entry: a kind, a tagged settings mapping or a
    settings object; ``names`` (``--strategies``) replaces the list, keeping an entry's settings
    where it names that entry's kind."""
    from pydantic import ValidationError

    from flotilla.config.messages import format_validation_error
    from flotilla.core.imports import import_by_name
    from flotilla.sync import registry

    def kind_of(e: Any) -> str:
        return e if isinstance(e, str) else str(e["kind"] if isinstance(e, dict) else e.kind)

    if names:
        given = {kind_of(e): e for e in entries if not isinstance(e, str)}
        entries = [given.get(k.strip(), k.strip()) for k in names.split(",") if k.strip()]
    kinds = [kind_of(e) for e in entries]
    out: list[tuple[str, Any]] = []
    for i, entry in enumerate(entries):
        kind = kinds[i]
        label = kind if kinds.count(kind) == 1 else f"{kind}#{kinds[:i].count(kind) + 1}"
        spec = registry.spec_of(kind)
        if not spec.simulated:
            out.append((label, None))
            continue
        try:
            settings = registry.settings_of({"kind": entry} if isinstance(entry, str) else entry)
        except ValidationError as err:
            raise ConfigError(f"strategies[{i}] ({kind}): {format_validation_error(err)}") from None
        make = import_by_name(
            spec.simulated, label=f"strategy {kind}: simulated", error=ConfigError, example="fn"
        )
        out.append((label, make(settings)))
    return out


def _verdict(rows: list[dict[str, Any]]) -> str:
    """Which strategy finished first, and which cost least (among those that completed)."""
    done = [r for r in rows if r.get("simulated") and r.get("completed")]
    if not done:
        return "no strategy completed the job"
    fast = min(done, key=lambda r: r["time_s"])
    cheap = min(done, key=lambda r: r["cost"])
    line = f"first to finish: {fast['strategy']} in {fast['time_s'] / 3600:.2f} h for ${fast['cost']:,.0f}"
    if cheap is not fast:
        line += f"; cheapest: {cheap['strategy']} in {cheap['time_s'] / 3600:.2f} h for ${cheap['cost']:,.0f}"
    return line


def simulate_command(
    config: Path,
    set_: Optional[list[str]] = typer.Option(None, "--set", help="Override a config value: a.b.c=value."),
    num_workers: Optional[int] = typer.Option(None, "--num-workers", help="Scale the cluster to N workers."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="A spot trace (time_ms,add|remove,node)."),
    time_scale: Optional[float] = typer.Option(
        None, "--time-scale", help="Trace seconds per simulated second."
    ),
    strategies: Optional[str] = typer.Option(None, "--strategies", help="Comma-separated kinds to compare."),
    step_s: Optional[float] = typer.Option(
        None, "--step-s", help="One worker's step on a speed-1 device (s)."
    ),
    price: Optional[list[str]] = typer.Option(None, "--price", help="TYPE=USD per device-hour (repeatable)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the comparison here."),
    calibration: Optional[Path] = typer.Option(
        None, "--calibration", help="A `flotilla calibrate` profile: this machine's measured links."
    ),
    plots: Optional[Path] = typer.Option(
        None, "--plots", help="Write the throughput and membership plots here."
    ),
) -> None:
    """Predict the job on the configured (or scaled) cluster and compare strategies."""
    from flotilla.cli.simulate_inputs import load_inputs, prices_of

    t_start = time.perf_counter()
    try:
        inputs = load_inputs(
            config, set_ or [], num_workers=num_workers, trace=trace, time_scale=time_scale, step_s=step_s,
            prices=prices_of(price or []), calibration=calibration,
            layers="pipeline" in {k.strip() for k in (strategies or "").split(",")},
        )  # fmt: skip
        chosen = _strategies(inputs.strategies, strategies)
    except (ConfigError, FlotillaError, ValueError) as exc:
        raise _fail(str(exc)) from None
    job, cluster = inputs.job, inputs.cluster
    devices = sum(c.count for c in cluster.classes)
    typer.echo(
        f"job: {inputs.described}; cluster: "
        + ", ".join(f"{c.count} x {c.type} (speed {c.speed:.3g})" for c in cluster.classes)
        + f" = {devices} devices"
        + (f"; trace {inputs.replayed}" if inputs.replayed else "")
    )
    rows: list[dict[str, Any]] = []
    timelines: dict[str, Any] = {}
    for n, (label, strategy) in enumerate(chosen, start=1):
        if strategy is None:
            typer.echo(f"{label:16s} not simulated yet (its spec has no `simulated` hook)")
            rows.append({"strategy": label, "simulated": False})
            continue
        typer.echo(f"[{n}/{len(chosen)}] simulating {label} ...", err=True)
        t0 = time.perf_counter()
        try:
            changes, left_out = _changes_for(strategy, inputs)
            result = strategy.simulate(job, cluster, changes=changes, recovery=inputs.recovery)
        except (ConfigError, ValueError) as exc:  # (e.g. a pipeline without a layer profile)
            raise _fail(f"{label}: {exc}") from None
        if left_out:
            result.note = f"{result.note}; {left_out}" if result.note else left_out
        took = time.perf_counter() - t0
        row = {**result.summary(), "strategy": label, "simulated": True, "wall_s": round(took, 3)}
        rows.append(row)
        timelines[label] = result.timeline
        done = "done" if result.completed else f"stopped at step {result.steps}"
        typer.echo(
            f"{label:16s} {done:>22s}  {result.time_s:12.1f} s  {result.steps_per_s:9.3f} steps/s  "
            f"{row['device_hours']:10.2f} device-h  ${row['cost']:10.2f}  {row['recoveries']:4d} recoveries  "
            f"({took:.2f} s to simulate){'  ' + result.note if result.note else ''}"
        )
    typer.echo(_verdict(rows))
    if json_out is not None:
        classes = [{"type": c.type, "count": c.count, "speed": c.speed} for c in cluster.classes]
        body = {"job": dataclasses.asdict(job), "devices": devices, "classes": classes}
        body |= {"trace": inputs.replayed, "rows": rows}
        json_out.write_text(json.dumps(body, indent=2) + "\n")
    if plots is not None:
        from flotilla.report.sim_plots import sim_plots

        written = sim_plots(plots, timelines, title=f"{devices:,} devices at the start")
        typer.echo("plots: " + ", ".join(str(p) for p in written))
    typer.echo(f"simulated in {time.perf_counter() - t_start:.1f} s", err=True)


def _changes_for(strategy: Any, inputs: Any) -> tuple[list[Any], str]:
    """The trace's device changes and, resolved for this strategy, the config's revocation events
    (``sim/schedule.py``: a step-anchored event happens when this strategy's job reaches the
    step); a note of what could not be simulated."""
    if not inputs.plan and (inputs.time_from_step is None or not inputs.changes):
        return list(inputs.changes), ""
    from flotilla.sim.schedule import schedule_changes

    def run(changes: list[Any]) -> Any:
        return strategy.simulate(inputs.job, inputs.cluster, changes=changes, recovery=inputs.recovery)

    return schedule_changes(
        inputs.plan,
        inputs.names,
        run,
        given=inputs.changes,
        given_from_step=inputs.time_from_step,
        recovery=inputs.recovery,
        peer_heartbeat_s=inputs.peer_heartbeat_s,
    )
