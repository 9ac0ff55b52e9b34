"""``flotilla simulate CONFIG``: predict a job on a (larger) cluster and compare strategies (SPEC §9,
``docs/simulator.md``).

The configuration gives the job (its model, batch, steps) and the cluster (its workers' types,
speeds and nodes, the links, transient slowdowns, a spot trace); the command:

1. measures one worker's step on this machine (the job's own task and model at the per-worker
   batch, forward, backward and the optimizer: the median of 5 after 2 warm-ups; a device of
   speed 1.0 is this machine) unless ``--step-s`` says it, and counts the model's bytes;
2. turns the cluster into device classes (workers of one type and speed; ``--num-workers``
   scales every class to that total; ``--price TYPE=USD`` per device-hour);
3. replays the spot trace (``--trace`` or the config's ``cluster.revocations.trace``) onto groups
   of devices with the runtime's replay rule (``sim/trace.py``);
4. simulates each strategy of ``--strategies`` (default: the config's) through its spec's
   ``simulated`` hook -- a kind without one is listed as not simulated -- and prints the
   comparison: time, steps per second, device-hours, cost, recoveries; ``--json`` writes it.

Errors are one line (``error: ...``) and exit status 2, naming the option or field.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import typer

from flotilla.core.errors import ConfigError, FlotillaError

__all__ = ["simulate_command"]


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def _prices(entries: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for e in entries:
        kind, _, value = e.partition("=")
        try:
            price = float(value)
        except ValueError:
            raise ConfigError(f"--price: expected TYPE=USD_PER_DEVICE_HOUR, got {e!r}") from None
        if not kind or not price >= 0:
            raise ConfigError(f"--price: expected TYPE=USD_PER_DEVICE_HOUR with a price >= 0, got {e!r}")
        out[kind] = price
    return out


def sim_cluster(cfg: Any, num_workers: int | None, prices: dict[str, float]) -> Any:
    """The configured cluster as device classes (workers of one type and speed; see the module
    doc); ``num_workers``: every class scaled to that total."""
    from flotilla.cluster.emulation import TransientSlowdown
    from flotilla.cluster.spec import Link
    from flotilla.sim.model import DeviceClass, SimCluster

    spec = cfg.cluster.spec()
    groups: dict[tuple[str, float], list[Any]] = {}
    for d in spec.devices:
        groups.setdefault((d.type, d.speed), []).append(d)
    counts = [len(g) for g in groups.values()]
    if num_workers is not None:
        if num_workers < len(groups):
            raise ConfigError(
                f"--num-workers: at least one per device class ({len(groups)}), got {num_workers}"
            )
        total = sum(counts)
        counts = [max(1, round(c * num_workers / total)) for c in counts]
        counts[-1] = max(1, counts[-1] + num_workers - sum(counts))
    unknown = sorted(set(prices) - {t for t, _ in groups})
    if unknown:
        raise ConfigError(
            f"--price: no worker has type {unknown[0]!r}; types: {sorted({t for t, _ in groups})}"
        )
    types = [t for t, _ in groups]
    classes = []
    for ((kind, speed), members), count in zip(groups.items(), counts):
        label = kind if types.count(kind) == 1 else f"{kind}@{speed:g}"
        per_node = max(sum(1 for m in members if m.node == n) for n in {m.node for m in members})
        classes.append(
            DeviceClass(
                type=label, count=count, speed=speed, per_node=per_node, price_per_hour=prices.get(kind, 0.0)
            )
        )
    link = Link(bandwidth_gbps=spec.links.default_bandwidth_gbps, latency_s=spec.links.latency_s)
    slow = cfg.cluster.defaults.slowdown
    slowdown = TransientSlowdown.of(slow, 0) if slow is not None else None
    return SimCluster(classes=tuple(classes), intra_node=link, inter_node=link, slowdown=slowdown)


def measure_step(cfg: Any) -> tuple[float, int, int, int]:
    """One worker's step on this machine (seconds, the median of 5 after 2 warm-ups), the model's
    bytes, the per-worker batch and the job's steps."""
    from flotilla.trainer import builders

    task = builders.build_task(cfg)
    model = builders.build_task_model(cfg, task)
    train, _ = builders.build_task_data(task)
    sampler = builders.task_sampler(cfg, train)
    steps = builders.total_steps(cfg, sampler)
    per_worker = max(1, cfg.job.batch_size // max(1, len(cfg.cluster.spec().devices)))
    opt = builders.build_optimizer(cfg, model)
    batch = train.batch(list(range(min(per_worker, train.num_samples))))
    times = []
    for i in range(7):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = task.loss(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return statistics.median(times), model_bytes, per_worker, steps


def _changes(cfg: Any, cluster: Any, trace: Path | None, time_scale: float | None) -> tuple[list[Any], str]:
    from flotilla.cluster.revocation_trace import parse_trace
    from flotilla.sim.trace import trace_changes

    section = cfg.cluster.revocations.trace if cfg.cluster.revocations is not None else None
    if trace is None and section is None:
        return [], ""
    path = trace if trace is not None else Path(section.file) if section is not None else None
    if path is None:
        return [], ""
    scale = time_scale if time_scale is not None else (section.time_scale if section is not None else 1.0)
    start_ms = section.start_ms if section is not None and trace is None else 0
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--trace: cannot read {path}: {exc.strerror}") from None
    events = parse_trace(text, source=str(path))
    changes, group = trace_changes(cluster, events, time_scale=scale, start_ms=start_ms)
    return changes, f"{path.name} x{scale:g}, {len(changes)} device changes, {group} device(s) per trace node"


def _strategies(cfg: Any, names: str | None) -> list[tuple[str, Any]]:
    from flotilla.core.imports import import_by_name
    from flotilla.sync import registry

    kinds = [k.strip() for k in names.split(",") if k.strip()] if names else [cfg.strategy.kind]
    out: list[tuple[str, Any]] = []
    for kind in kinds:
        spec = registry.spec_of(kind)
        if not spec.simulated:
            out.append((kind, None))
            continue
        settings = cfg.strategy if kind == cfg.strategy.kind else registry.settings_of({"kind": kind})
        make = import_by_name(
            spec.simulated, label=f"strategy {kind}: simulated", error=ConfigError, example="fn"
        )
        out.append((kind, make(settings)))
    return out


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
) -> None:
    """Predict the job on the configured (or scaled) cluster and compare strategies."""
    from flotilla.config import load_config
    from flotilla.sim.model import SimJob

    try:
        cfg = load_config(config, set_ or [])
        if step_s is not None and not step_s > 0:
            raise ConfigError(f"--step-s: must be > 0, got {step_s}")
        cluster = sim_cluster(cfg, num_workers, _prices(price or []))
        measured, model_bytes, per_worker, steps = measure_step(cfg)
        job = SimJob(
            steps=steps, step_s=step_s or measured, model_bytes=model_bytes, batch_per_worker=per_worker
        )
        changes, replayed = _changes(cfg, cluster, trace, time_scale)
        chosen = _strategies(cfg, strategies)
    except (ConfigError, FlotillaError, ValueError) as exc:
        raise _fail(str(exc)) from None
    devices = sum(c.count for c in cluster.classes)
    typer.echo(
        f"job: {job.steps} steps, {job.step_s * 1000:.2f} ms per step on a speed-1 device "
        f"({'given' if step_s else 'measured here'}), model {model_bytes / 1e6:.2f} MB; cluster: "
        + ", ".join(f"{c.count} x {c.type} (speed {c.speed:g})" for c in cluster.classes)
        + f" = {devices} devices"
        + (f"; trace {replayed}" if replayed else "")
    )
    rows = []
    for kind, strategy in chosen:
        if strategy is None:
            typer.echo(f"{kind:16s} not simulated yet (its spec has no `simulated` hook)")
            rows.append({"strategy": kind, "simulated": False})
            continue
        t0 = time.perf_counter()
        result = strategy.simulate(job, cluster, changes=changes)
        took = time.perf_counter() - t0
        row = {**result.summary(), "simulated": True, "wall_s": round(took, 3)}
        rows.append(row)
        done = "done" if result.completed else f"stopped at step {result.steps}"
        typer.echo(
            f"{kind:16s} {done:>22s}  {result.time_s:12.1f} s  {result.steps_per_s:9.3f} steps/s  "
            f"{row['device_hours']:10.2f} device-h  ${row['cost']:10.2f}  {row['recoveries']:4d} recoveries  "
            f"({took:.2f} s to simulate){'  ' + result.note if result.note else ''}"
        )
    if json_out is not None:
        json_out.write_text(
            json.dumps({"job": dataclasses.asdict(job), "devices": devices, "rows": rows}, indent=2) + "\n"
        )
