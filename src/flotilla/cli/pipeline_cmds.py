"""``flotilla profile`` and ``flotilla plan``: the pipeline planning commands (SPEC §3.1, §3.2).

Both are plain functions with typer-compatible signatures; ``flotilla.cli.main`` registers them with
``app.command("profile")(profile_command)`` and ``app.command("plan")(plan_command)``.

- ``profile CONFIG [--out PATH]``: builds the job's task (the user's ``job.task`` or the zoo's),
  its model and data, runs one minibatch of ``job.batch_size`` samples through the model's layers
  one by one, closed by the task's loss (one CPU thread, a device of speed 1.0) and
  writes the ``ModelProfile`` JSON; prints one line per layer (times, output, what it saves for
  its backward, parameters).
- ``plan CONFIG [--profile PATH]``: partitions the model over ``cluster.workers`` (speed and memory
  of each) with the heterogeneous partitioner (stage count, cut points, device(s) per stage,
  replication) and prints the plan: stages, devices, predicted per-stage time, bottleneck and
  throughput; then the split ``flotilla run`` uses for the configured ``strategy.num_stages``
  (stage i on ``cluster.workers[i]``).  Without ``--profile`` the model is profiled first.
  A plan that does not fit in memory is refused with one line naming the device and the shortfall.
  With ``--virtual-workers [--placement np|ed|hd|auto] [--s-local N] [--clock-distance D]``: the
  virtual workers HetPipe would form of all the cluster's workers (by their ``node`` and
  ``type``) under each placement, each VW's stages with their memory against the device's
  budget, the predicted wave and throughput, and the choice (``pipeline/vw_placement.py``).
  A strategy that places its pipeline instances itself (``strategy: {kind: hetpipe, placement:
  np|ed|hd|auto}``) prints that placement instead: the one ``flotilla run`` starts, with the
  model profiled at its instances' share of a batch (``--profile``: that profile as measured).

Errors are one line on stderr (``error: ...``); configuration and plan errors exit with status 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from flotilla.core.errors import ConfigError

__all__ = ["plan_command", "profile_command"]

_SET = typer.Option(None, "--set", help="Override a config value: a.b.c=value (repeatable).")


def _fail(exc: Exception | str) -> typer.Exit:
    typer.echo(f"error: {' '.join(str(exc).split())}", err=True)
    return typer.Exit(2)


def _load(config: Path, set_: Optional[list[str]]):
    from flotilla.config import PipelineStrategy, load_config

    cfg = load_config(config, set_ or [])
    if not isinstance(cfg.strategy, PipelineStrategy):
        raise ConfigError(
            f"strategy.kind must be 'pipeline' to profile or plan a pipeline, got {cfg.strategy.kind!r}"
        )
    return cfg


_WIDTHS = (22, 10, 11, 11, 10, 10)


def profile_command(
    config: Path = typer.Argument(..., help="Run configuration (YAML)."),
    set_: Optional[list[str]] = _SET,
    out: Path = typer.Option(Path("profile.json"), "--out", help="Where to write the profile JSON."),
) -> None:
    """Profile the model layer by layer and write a JSON profile for `flotilla plan`."""
    from flotilla.pipeline.plan import format_bytes
    from flotilla.trainer.pipeline_setup import profile_for_config

    try:
        profile = profile_for_config(_load(config, set_))
        profile.save(out)
    except (ConfigError, OSError) as exc:
        raise _fail(exc) from None
    header = ("layer", "forward_ms", "backward_ms", "activation", "saved", "params")
    typer.echo(
        " ".join(h.ljust(22) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, _WIDTHS)))
    )
    for layer in profile.layers:  # (saved: what the layer keeps for its backward besides in/output)
        saved = format_bytes(layer.saved_bytes) if layer.saved_bytes is not None else "-"
        typer.echo(
            f"{layer.name:<22} {layer.forward_s * 1e3:>10.3f} {layer.backward_s * 1e3:>11.3f} "
            f"{format_bytes(layer.activation_bytes):>11} {saved:>10} {format_bytes(layer.param_bytes):>10}"
        )
    typer.echo(
        f"batch {profile.batch_size}, input {format_bytes(profile.input_bytes)}, "
        f"total {profile.total_compute_s * 1e3:.3f} ms per minibatch on {profile.device_name}; wrote {out}"
    )


def plan_command(
    config: Path = typer.Argument(..., help="Run configuration (YAML)."),
    set_: Optional[list[str]] = _SET,
    profile: Optional[Path] = typer.Option(
        None, "--profile", help="Profile JSON from `flotilla profile` (default: profile the model now)."
    ),
    virtual_workers: bool = typer.Option(
        False,
        "--virtual-workers",
        help="Print HetPipe's virtual workers of the cluster instead (placements np, ed, hd by "
        "worker node and type; docs/hetpipe.md).",
    ),
    placement: str = typer.Option("auto", "--placement", help="With --virtual-workers: np, ed, hd or auto."),
    s_local: int = typer.Option(
        0, "--s-local", help="With --virtual-workers: a wave is s_local + 1 minibatches."
    ),
    clock_distance: int = typer.Option(0, "--clock-distance", help="With --virtual-workers: WSP's D."),
) -> None:
    """Partition the model over the cluster's devices and print the plan."""
    from flotilla.pipeline.partition import format_plan, partition
    from flotilla.pipeline.plan import format_bytes
    from flotilla.pipeline.profile import ModelProfile
    from flotilla.trainer.pipeline_setup import (
        partition_options,
        pipeline_cluster,
        plan_for_run,
        profile_for_config,
    )

    try:
        cfg = _load(config, set_)
        if not virtual_workers and _placed(cfg, profile):
            return
        prof = ModelProfile.load(profile) if profile is not None else profile_for_config(cfg)
        if virtual_workers:
            _virtual_workers(cfg, prof, placement, s_local, clock_distance)
            return
        cluster = pipeline_cluster(cfg)
        best = partition(prof, cluster, options=partition_options(cfg))
    except (ConfigError, OSError) as exc:
        raise _fail(exc) from None
    names = ", ".join(
        f"{d.name} (speed {d.speed:g}, {format_bytes(d.memory_bytes)})" for d in cluster.devices
    )
    task_name = cfg.job.model.name if cfg.job.model is not None else cfg.job.task
    typer.echo(f"model: {task_name}, {prof.num_layers} layers; devices: {names}")
    typer.echo("best plan (partitioner: any stage count, replication allowed):")
    typer.echo(format_plan(best))
    typer.echo("")
    try:
        run_plan = plan_for_run(cfg, prof)
    except ConfigError as exc:
        raise _fail(f"flotilla run cannot use {cfg.strategy.num_stages} stage(s): {exc}") from None
    p, r = cfg.strategy.num_stages, cfg.strategy.replicas
    if r == 1:
        typer.echo(f"flotilla run uses {p} stage(s), stage i on cluster.workers[i]:")
    else:
        typer.echo(
            f"flotilla run uses {p} stage(s) x {r} pipeline instances, stage i of instance k on "
            f"cluster.workers[k * {p} + i], each instance on 1/{r} of every batch; one split for all, "
            "planned over the weakest device of each position (named by instance 0's):"
        )
    typer.echo(format_plan(run_plan))
    _ties(cfg, run_plan)


def _placed(cfg: Any, profile: Path | None) -> bool:
    """Print the placement of a strategy that places its own pipeline instances (False: it does not)."""
    from flotilla.launch.pipeline_checks import refuse_ties
    from flotilla.launch.pipeline_prepare import placed_instances
    from flotilla.pipeline.profile import ModelProfile
    from flotilla.trainer.pipeline_setup import pipeline_parts

    given = ModelProfile.load(profile) if profile is not None else None
    placed = placed_instances(cfg, lambda: pipeline_parts(cfg), given)  # (parts: only to profile)
    if placed is None:
        return False
    try:  # (what flotilla run would refuse: a tie pipedream cannot keep across two stages)
        refuse_ties(cfg, pipeline_parts(cfg).model, [i.plan for i in placed.instances])
    except ConfigError as exc:
        raise _fail(exc) from None
    task_name = cfg.job.model.name if cfg.job.model is not None else cfg.job.task
    typer.echo(
        f"model: {task_name}, {placed.profile.num_layers} layers, "
        f"profiled at {placed.profile.batch_size} samples"
    )
    typer.echo(placed.report)
    runs = "; ".join(f"VW {k}: " + ", ".join(i.devices) for k, i in enumerate(placed.instances))
    typer.echo(f"flotilla run starts {placed.summary['policy']}: {runs}")
    return True


def _virtual_workers(cfg: Any, prof: Any, placement: str, s_local: int, clock_distance: int) -> None:
    """HetPipe's placements of every worker of the cluster (``pipeline/vw_placement.py``)."""
    from dataclasses import replace

    from flotilla.pipeline.schedule import ScheduleKind
    from flotilla.pipeline.vw_placement import WaveSettings, choose
    from flotilla.pipeline.vw_report import format_choice
    from flotilla.trainer.pipeline_setup import partition_options

    cluster = cfg.cluster.spec()
    settings = WaveSettings(s_local=s_local, clock_distance=clock_distance)
    # (a VW runs PipeDream with s_local + 1 minibatches in flight, whatever the config's schedule)
    options = replace(
        partition_options(cfg),
        schedule=ScheduleKind.PIPEDREAM,
        num_microbatches=1,
        vertical_sync=False,
        in_flight=s_local + 1,
    )
    choice = choose(cluster, prof, placement, options, settings)
    nodes = ", ".join(
        f"{node}: "
        + " ".join(f"{d.name}({d.type}, speed {d.speed:g})" for d in cluster.devices_of_node(node))
        for node in cluster.nodes
    )
    typer.echo(f"model: {prof.num_layers} layers; nodes: {nodes}")
    typer.echo(format_choice(choice, cluster, settings, placement, prof, options))


def _ties(cfg: Any, run_plan: Any) -> None:
    """The parameters the run's split ties across stages: kept tied (flushing schedules), or the
    one-line refusal ``flotilla run`` would give (pipedream)."""
    from flotilla.pipeline.model_check import refuse_split_ties, split_ties
    from flotilla.pipeline.split import layer_ends_of
    from flotilla.trainer.pipeline_setup import pipeline_parts

    model, ends = pipeline_parts(cfg).model, layer_ends_of(run_plan)
    if cfg.strategy.schedule == "pipedream":
        try:
            refuse_split_ties(model, ends, cfg.strategy.schedule)
        except ConfigError as exc:
            raise _fail(exc) from None
    for tie in split_ties(model, ends):
        stages = ", ".join(map(str, tie.stages))
        typer.echo(f"tied across stages {stages}: {tie.name} (its gradient is summed at every flush)")
