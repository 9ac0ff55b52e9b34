"""What ``flotilla simulate`` measures on this machine for a training config (``cli/simulate_inputs.py``
assembles the inputs): the job's step (:func:`measure_step`), the speed each emulated device
class really reaches here (:func:`emulated_speeds`), the layers' profile of a pipeline
(:func:`layer_profile`), and a ``flotilla calibrate`` profile's links (:func:`calibrated_link`).
Errors are ``ConfigError`` with one line naming the option."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from flotilla.core.errors import ConfigError

__all__ = [
    "EMULATED_REPEATS",
    "calibrated_link",
    "emulated_speeds",
    "layer_profile",
    "measure_step",
    "optimizer_per_layer",
    "step_parts",
]


def measure_step(cfg: Any, speeds: Sequence[float] = ()) -> tuple[float, int, int, int, dict[float, float]]:
    """One worker's step on this machine (seconds, the median of 5 after 2 warm-ups, with the
    intra-op threads a worker of this job gets here: ``core/threads.py``), the model's bytes, the
    per-worker batch, the job's steps, and the speed each emulated one of ``speeds`` reaches here
    (:func:`emulated_speeds`)."""
    import torch

    from flotilla.core.threads import LOCAL_PROCS_VAR, thread_count, usable_cores
    from flotilla.trainer import builders

    workers = max(1, len(cfg.cluster.spec().devices))
    before = torch.get_num_threads()
    torch.set_num_threads(thread_count({LOCAL_PROCS_VAR: str(workers)}, usable_cores()))
    try:
        step, model_bytes, per_worker, steps = _measure(cfg, builders, workers)
        times = [step() for _ in range(7)][2:]
        warm = statistics.median(times)
        return warm, model_bytes, per_worker, steps, emulated_speeds(step, speeds, warm)
    finally:
        torch.set_num_threads(before)


def _measure(cfg: Any, builders: Any, workers: int) -> tuple[Callable[[], float], int, int, int]:
    """The job's step on one worker's batch (a function timing one), the model's bytes, the
    per-worker batch and the job's steps."""
    task, model, opt, batch, train = step_parts(cfg, workers)
    steps = builders.total_steps(cfg, builders.task_sampler(cfg, train))
    per_worker = max(1, cfg.job.batch_size // workers)

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = task.loss(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return step, model_bytes, per_worker, steps


def step_parts(cfg: Any, workers: int) -> tuple[Any, Any, Any, Any, Any]:
    """What one worker of ``cfg``'s job (of ``workers``) computes a step with: the task, its model,
    the job's optimizer, one worker's batch (``batch_size // workers`` samples) and the training
    data (here and in ``cli/simulate_together.py``'s processes)."""
    from flotilla.trainer import builders

    task = builders.build_task(cfg)
    model = builders.build_task_model(cfg, task)
    train, _ = builders.build_task_data(task)
    opt = builders.build_optimizer(cfg, model)
    per_worker = max(1, cfg.job.batch_size // workers)
    return task, model, opt, train.batch(list(range(min(per_worker, train.num_samples)))), train


EMULATED_REPEATS = 12  # steps timed per emulated speed (the first 2 not counted)
EMULATED_BUDGET_S = 10.0  # at most this long per emulated speed (fewer steps for slow ones, >= 5)


def emulated_speeds(step: Callable[[], float], speeds: Sequence[float], warm_s: float) -> dict[float, float]:
    """The speed each emulated device class (``speed`` < 1) really reaches on this machine, by
    running ``step`` as ``cluster/emulation.SpeedEmulator`` runs it: each step followed by a sleep
    of ``(1 / speed - 1)`` times its compute.  A step that comes after a sleep is slower than one
    in a tight loop (caches and idle cores grow cold: measured on the 2-core VM, +4 % at speed
    0.5, +17 % at 0.25, +50 % at 0.083), and the emulator stretches what it measures, so an
    emulated device of speed ``s`` runs at ``s * warm / cold``.  Devices of speed 1 never sleep:
    unchanged."""
    out: dict[float, float] = {}
    for speed in sorted({s for s in speeds if s < 1.0}):
        cold = []
        repeats = max(5, min(EMULATED_REPEATS, int(EMULATED_BUDGET_S * speed / max(warm_s, 1e-9))))
        for i in range(repeats):
            took = step()
            if i >= 2:
                cold.append(took)
            time.sleep(took * (1.0 / speed - 1.0))
        out[speed] = speed * min(1.0, warm_s / statistics.median(cold))
    return out


def layer_profile(
    cfg: Any, step_s: float | None, per_worker: int, devices: int
) -> tuple[Any, tuple[float, ...]]:
    """The model's layers as ``flotilla plan`` profiles them (one thread), but on one microbatch of
    a pipeline instance's share of the batch: the size its stages run (an operator's fixed cost
    does not shrink with the batch: a minibatch's profile scaled down underestimated a stage,
    docs/simulator.md); with ``--step-s``, every layer's time scaled so that the whole model's
    forward and backward for one worker's batch takes that long.  ``devices``: the simulated
    cluster's, which make ``devices // num_stages`` instances sharing every batch."""
    import dataclasses as dc

    from flotilla.sync.pipeline_settings import PipelineStrategy
    from flotilla.trainer.pipeline_setup import profile_for_config

    if not isinstance(cfg.strategy, PipelineStrategy):  # (--strategies names a pipeline: its defaults)
        cfg = cfg.model_copy(update={"strategy": PipelineStrategy()})
    st = cfg.strategy
    if st.schedule != "pipedream":  # (profiled at the size a stage runs in the simulation)
        instances = max(1, min(devices // st.num_stages, cfg.job.batch_size // st.num_microbatches))
        micro = max(1, cfg.job.batch_size // instances // st.num_microbatches)
        cfg = cfg.model_copy(update={"job": cfg.job.model_copy(update={"batch_size": micro * st.replicas})})
    profile = profile_for_config(cfg, num_warmup=3, num_repeats=15)  # (medians of 15: one run is the figure)
    updates = optimizer_per_layer(cfg)
    if step_s is None:
        return profile, updates
    whole = sum(layer.compute_s for layer in profile.layers) * per_worker / profile.batch_size
    factor = step_s / whole if whole > 0 else 1.0
    scaled_layers = tuple(
        dc.replace(layer, forward_s=layer.forward_s * factor, backward_s=layer.backward_s * factor)
        for layer in profile.layers
    )
    return dc.replace(profile, layers=scaled_layers), tuple(u * factor for u in updates)


def optimizer_per_layer(cfg: Any, repeats: int = 7) -> tuple[float, ...]:
    """The job's optimizer step over each layer's parameters alone (seconds, one thread, the
    median of ``repeats`` after 3 warm-ups; 0 for a layer without parameters): what a pipeline
    stage's update costs, the sum over its layers (a stage runs one optimizer over its own)."""
    import torch

    from flotilla.trainer.builders import make_optimizer
    from flotilla.trainer.pipeline_setup import pipeline_parts

    model = pipeline_parts(cfg).model
    out = []
    for layer in model:
        params = [p for p in layer.parameters() if p.requires_grad]
        if not params:
            out.append(0.0)
            continue
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = make_optimizer(cfg.job.optimizer, params)
        times = []
        for i in range(3 + repeats):
            t0 = time.perf_counter()
            opt.step()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return tuple(out)


def calibrated_link(path: Path) -> tuple[Any, Any, int]:
    """The all-reduce link of a ``flotilla calibrate`` profile (``launch/calibrate.py``), the
    message plane's own cost (``None`` in a version-1 profile, which did not measure it) and the
    number of processes it was measured with."""
    import json

    from flotilla.cluster.spec import Link

    def link_of(d: Any, what: str) -> Any:
        bw, lat = float(d["bandwidth_gbps"]), float(d["latency_s"])
        if not (bw > 0 and lat >= 0):
            raise ConfigError(
                f"--calibration: {path}: {what}: bandwidth must be > 0 and latency >= 0, got {bw}, {lat}"
            )
        return Link(bandwidth_gbps=bw, latency_s=lat)

    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        link = link_of(body["allreduce_link"], "allreduce_link")
        software = link_of(body["msgplane_cost"], "msgplane_cost") if "msgplane_cost" in body else None
        world_size = int(body.get("world_size", 2))
    except FileNotFoundError:
        raise ConfigError(f"--calibration: no such file {path}") from None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ConfigError(f"--calibration: {path} is not a flotilla calibrate profile ({exc!r})") from None
    return link, software, world_size
