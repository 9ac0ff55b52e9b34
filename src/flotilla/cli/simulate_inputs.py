"""What ``flotilla simulate`` simulates: a training config's job and cluster, or a sizing file's
(``cli/simulate_cmd.py``, ``docs/simulator.md``).

- a **training config** (``flotilla run``'s): the job's own task and model are measured on this
  machine (``cli/simulate_measure.measure_step``: forward, backward and the optimizer at the
  per-worker batch, the median of 5 after 2 warm-ups; a device of speed 1.0 is this machine) and
  its cluster becomes device classes (``cli/simulate_cluster.sim_cluster``: workers of one type
  and speed); unless
  ``--step-s`` is given, every class gets the speed its devices reach here: for a data-parallel
  job of 2-16 devices, not scaled, every device run at once as the job will run them
  (``cli/simulate_together.py``: the runtime's unit and emulation in a process per device; the
  spread of their steps becomes the simulated cluster's step jitter, where the config sets no
  slowdown), else each emulated class (speed < 1) alone (``simulate_measure.emulated_speeds``:
  the step run as the emulator runs it, each followed by its sleep);
- a **sizing file** (a top-level ``simulate:`` section, ``sim/sizing.py``): catalogued or
  described accelerators and a model shape; nothing is measured.

Either may be scaled to ``--num-workers`` (every class in proportion) and replays a spot trace
onto groups of devices with the runtime's replay rule (``sim/trace.py``).  Errors are
``ConfigError`` / ``ValueError`` with one line naming the option or field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from flotilla.cli.simulate_cluster import device_names, scaled, sim_cluster
from flotilla.cli.simulate_measure import calibrated_link, layer_profile, measure_step
from flotilla.cluster.launch_plan import Runner
from flotilla.core.errors import ConfigError

__all__ = [
    "SimInputs",
    "config_changes",
    "load_inputs",
    "prices_of",
    "replay_onto",
]


def prices_of(entries: list[str]) -> dict[str, float]:
    """``--price TYPE=USD`` entries as a mapping."""
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


def replay_onto(cluster: Any, text: str, source: str, scale: float, start_ms: int) -> tuple[list[Any], str]:
    """A trace's text replayed onto ``cluster`` (``sim/trace.py``) and a line saying so."""
    from flotilla.cluster.revocation_trace import parse_trace
    from flotilla.sim.trace import trace_changes

    events = parse_trace(text, source=source)
    changes, group = trace_changes(cluster, events, time_scale=scale, start_ms=start_ms)
    name = Path(source).name
    return changes, f"{name} x{scale:g}, {len(changes)} device changes, {group} device(s) per trace node"


def _together(cfg: Any, num_workers: int | None, devices: list[float]) -> bool:
    """Whether the job's devices are measured together (``cli/simulate_together.py``): a
    data-parallel job whose devices all run here (not scaled by ``--num-workers``), 2 to
    ``MAX_PROCESSES`` of them.  A pipeline's stages run other work than a whole step."""
    from flotilla.cli.simulate_together import MAX_PROCESSES

    if num_workers is not None and num_workers != len(devices):
        return False
    if cfg.strategy_spec.launch.runner is Runner.PIPELINE:
        return False
    return 2 <= len(devices) <= MAX_PROCESSES


def _how_measured(together: bool, stages: bool) -> str:
    if stages:
        return "every stage at once, action by action"
    return "every device at once" if together else "after the sleeps"


def _stages_together(cfg: Any, num_workers: int | None, devices: list[float]) -> bool:
    """Whether a pipeline's stages are measured together (``cli/simulate_stages.py``): a
    ``kind: pipeline`` job whose stages all run here (not scaled by ``--num-workers``), at most
    ``MAX_PROCESSES`` of them.  (HetPipe's split is its placement's, decided in the simulation.)"""
    from flotilla.cli.simulate_together import MAX_PROCESSES
    from flotilla.sync.pipeline_settings import PipelineStrategy

    if num_workers is not None and num_workers != len(devices):
        return False
    pipeline = isinstance(cfg.strategy, PipelineStrategy) and cfg.strategy.kind == "pipeline"
    return pipeline and 1 <= len(devices) <= MAX_PROCESSES


def _measure_stages(cfg: Any, profile: Any, updates: tuple[float, ...]) -> Any:
    """Each nominal speed's effective speed as the job's stages run here, together: the runtime's
    split of ``profile`` (``trainer/pipeline_setup.plan_for_run``), stage i of instance r on the
    (r * num_stages + i)-th worker (``cli/simulate_stages.py``)."""
    from flotilla.cli.simulate_stages import run_stages_together
    from flotilla.trainer.pipeline_setup import pipeline_strategy, plan_for_run

    st = pipeline_strategy(cfg)
    devices = cfg.cluster.spec().devices
    ends = [stage.layer_end for stage in plan_for_run(cfg, profile).stages]  # (replicas: planning_cluster)
    starts = [0, *ends[:-1]]
    stages = [(starts[i % st.num_stages], ends[i % st.num_stages], d.speed) for i, d in enumerate(devices)]
    return run_stages_together(cfg, stages, profile, updates, profile.batch_size)


def _with_jitter(cluster: Any, jitter: float, seed: int) -> Any:
    """``cluster`` with the measured jitter as its transient slowdown (a barrier, or a flush, waits
    for its slowest member), unless the config has one of its own."""
    if cluster.slowdown is not None or not jitter > 0:
        return cluster
    from flotilla.cluster.emulation import TransientSlowdown

    return dataclasses.replace(cluster, slowdown=TransientSlowdown(jitter_sigma=jitter, seed=seed))


def revocation_plan(cfg: Any, job: Any, cluster: Any) -> tuple[Any, ...]:
    """The config's explicit revocation events and random rate as the runtime plans them
    (``cluster/revocations.plan_revocations``; its trace is replayed apart, onto groups of
    devices: :func:`config_changes`); random kills up to a horizon of 10x the job's time without
    revocations on its slowest device, plus an hour."""
    section = cfg.cluster.revocations
    if section is None or (not section.events and section.random is None):
        return ()
    from flotilla.cluster.revocations import plan_revocations

    schedule = dataclasses.replace(section.schedule(), trace=None)
    slowest = min(c.speed for c in cluster.classes)
    horizon_s = 10 * job.steps * job.step_s / slowest + 3600.0
    workers = [d.name for d in cfg.cluster.spec().devices]
    return plan_revocations(schedule, workers, horizon_s=horizon_s, horizon_steps=job.steps)


def config_changes(
    cfg: Any, cluster: Any, trace: Path | None, time_scale: float | None
) -> tuple[list[Any], str]:
    """The device changes of the spot trace (``--trace``, else the config's) on ``cluster``, and a
    line saying what was replayed."""
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
    return replay_onto(cluster, text, str(path), scale, start_ms)


@dataclass(frozen=True, kw_only=True, slots=True)
class SimInputs:
    """What to simulate: the job, the cluster, the recovery costs, the device changes (and a line
    saying what trace was replayed), the strategies (kind names or tagged settings mappings), a
    line describing the job and where its step time came from."""

    job: Any
    cluster: Any
    recovery: Any
    changes: list[Any]
    replayed: str
    strategies: list[Any]
    described: str
    plan: tuple[Any, ...] = ()  # the config's revocation events and random rate (sim/schedule.py)
    time_from_step: int | None = None  # (the schedule's: a trace's clock starts at that step too)
    names: dict[str, str] = dataclasses.field(default_factory=dict)  # worker -> simulated device
    peer_heartbeat_s: float = 0.25  # (the config's: how soon a stopped worker is out: sim/schedule.py)


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not YAML ({str(exc).splitlines()[0]})") from None


def _sizing_inputs(
    path: Path, data: Any, num_workers: int | None, trace: Path | None, time_scale: float | None,
    prices: dict[str, float],
) -> SimInputs:  # fmt: skip
    from flotilla.sim.sizing import sizing_of

    try:
        s = sizing_of(data)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    cluster = s.cluster
    unknown = sorted(set(prices) - {c.type for c in cluster.classes})
    if unknown:
        raise ConfigError(
            f"--price: no device has type {unknown[0]!r}; types: {[c.type for c in cluster.classes]}"
        )
    counts = [c.count for c in cluster.classes]
    if num_workers is not None:
        counts = scaled(counts, num_workers)
    classes = tuple(
        dataclasses.replace(c, count=n, price_per_hour=prices.get(c.type, c.price_per_hour))
        for c, n in zip(cluster.classes, counts)
    )
    cluster = dataclasses.replace(cluster, classes=classes)
    changes: list[Any] = []
    replayed = ""
    if trace is not None or s.trace is not None:
        source = trace if trace is not None else (path.parent / s.trace.file if s.trace else None)
        assert source is not None
        scale = time_scale if time_scale is not None else (s.trace.time_scale if s.trace else 1.0)
        start = s.trace.start_ms if s.trace is not None and trace is None else 0
        try:
            text = source.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"simulate.trace.file: cannot read {source}: {exc.strerror}") from None
        changes, replayed = replay_onto(cluster, text, str(source), scale, start)
    f = s.figures
    described = (
        f"model {s.model_name}: {f.flops_per_sample:.3g} FLOPs per sample, "
        f"{f.exchange_bytes / 1e9:.2f} GB per exchange, {s.worker_bytes / 2**30:.1f} GiB per worker; "
        f"{s.job.steps} steps of "
        f"{s.job.batch_per_worker} samples per worker, {s.job.step_s:.3f} s per step on a {classes[0].type} "
        "(catalog figures)"
    )
    return SimInputs(job=s.job, cluster=cluster, recovery=s.recovery, changes=changes, replayed=replayed,
                     strategies=s.strategies, described=described)  # fmt: skip


def load_inputs(
    path: Path, overrides: list[str], *, num_workers: int | None, trace: Path | None,
    time_scale: float | None, step_s: float | None, prices: dict[str, float],
    calibration: Path | None = None, layers: bool = False,
) -> SimInputs:  # fmt: skip
    """A sizing file's or a training config's inputs (see the module doc); ``layers``: measure
    the model's layer profile too (a pipeline's simulation needs it; always for a pipeline
    config)."""
    from flotilla.config import load_config
    from flotilla.sim.model import Recovery, SimJob

    if step_s is not None and not step_s > 0:
        raise ConfigError(f"--step-s: must be > 0, got {step_s}")
    data = _read_yaml(path)
    if isinstance(data, dict) and "simulate" in data:
        if step_s is not None or calibration is not None:
            raise ConfigError(
                "--step-s and --calibration apply to a training config (calibrate measures only "
                "this machine); a sizing file's figures are the catalog's"
            )
        if overrides:  # (the same --set grammar; the sizing schema checks the result)
            from flotilla.config.load import apply_overrides

            data = apply_overrides(data, overrides, checked=False)
        return _sizing_inputs(path, data, num_workers, trace, time_scale, prices)
    cfg = load_config(path, overrides)
    cluster = sim_cluster(cfg, num_workers, prices)
    calibrated_note = ""
    if calibration is not None:
        link, software, world_size = calibrated_link(calibration)
        if cfg.cluster.links.emulate:  # (the job runs over its emulated links: they are the links;
            # the message plane's own cost comes on top of them, as it does at run time)
            cluster = dataclasses.replace(cluster, message_plane=software)
            calibrated_note = "; the links emulated (cluster.links.emulate): the calibrated link not used"
        else:
            cluster = dataclasses.replace(cluster, intra_node=link, inter_node=link, message_plane=software)
        processes = sum(c.count for c in cluster.classes)
        if processes != world_size:  # (a collective's latency depends on how many share the cores)
            calibrated_note += f"; note: calibrated with {world_size} processes, the job runs {processes}"
            if 2 <= processes <= 16:  # (what calibrate accepts)
                calibrated_note += f" (`flotilla calibrate --world-size {processes}` measures this job's)"
    devices = [d.speed for d in cfg.cluster.spec().devices]
    together = step_s is None and _together(cfg, num_workers, devices)
    stages = step_s is None and _stages_together(cfg, num_workers, devices)
    speeds = [c.speed for c in cluster.classes] if step_s is None and not (together or stages) else []
    measured, model_bytes, per_worker, steps, effective = measure_step(cfg, speeds)
    jitter = 0.0
    if together:  # (every device of the job at once, as the job will run them here)
        from flotilla.cli.simulate_together import run_together

        ran = run_together(cfg, devices, measured)
        effective, jitter = ran.effective, ran.sigma
        cluster = _with_jitter(cluster, jitter, cfg.job.seed)
    profile, updates = None, tuple[float, ...]()
    if layers or cfg.strategy_spec.launch.runner is Runner.PIPELINE:  # (pipeline, hetpipe)
        profile, updates = layer_profile(cfg, step_s, per_worker, sum(c.count for c in cluster.classes))
    if stages:  # (a stage's short actions, as they run here: colder than a whole step)
        ran = _measure_stages(cfg, profile, updates)
        effective, jitter = ran.effective, ran.sigma
        cluster = _with_jitter(cluster, jitter, cfg.job.seed)
    if effective:  # (the emulated devices as they run here: measured, not assumed)
        cluster = dataclasses.replace(
            cluster,
            classes=tuple(
                dataclasses.replace(c, speed=effective.get(c.speed, c.speed)) for c in cluster.classes
            ),
        )
    from flotilla.trainer.optim import state_per_weight

    job = SimJob(steps=steps, step_s=step_s or measured, model_bytes=model_bytes, batch_per_worker=per_worker,
                 profile=profile, global_batch=cfg.job.batch_size,
                 optimizer_multiplier=state_per_weight(cfg.job.optimizer), optimizer_s=updates)  # fmt: skip
    changes, replayed = config_changes(cfg, cluster, trace, time_scale)
    described = (
        f"{job.steps} steps, {job.step_s * 1000:.2f} ms per step on a speed-1 device "
        f"({'given' if step_s else 'measured here'}), model {model_bytes / 1e6:.2f} MB"
        + (f"; links calibrated ({calibration.name}){calibrated_note}" if calibration is not None else "")
        + (
            f"; speeds as measured here ({_how_measured(together, stages)}): "
            + ", ".join(f"{k:g} -> {v:.3g}" for k, v in sorted(effective.items()))
            + (f", step jitter sigma {jitter:.3f}" if jitter else "")
            if effective
            else ""
        )
    )
    plan = revocation_plan(cfg, job, cluster)
    section = cfg.cluster.revocations
    if plan:
        described += f"; {len(plan)} revocation event(s) of cluster.revocations"
    return SimInputs(job=job, cluster=cluster, recovery=Recovery(), changes=changes, replayed=replayed,
                     strategies=[cfg.strategy], described=described, plan=plan,
                     names=device_names(cfg, cluster), peer_heartbeat_s=cfg.cluster.peer_heartbeat_s,
                     time_from_step=section.time_from_step if section is not None else None)  # fmt: skip
