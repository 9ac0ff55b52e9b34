"""``flotilla run`` for ``strategy.kind == "pipeline"``: plan, one process per stage, reports.

``run_pipeline_job(cfg, report_dir, run_dir, progress, spawn=..., kill_all=...)``:

1. checks that the cluster has one worker per stage (stage i runs on ``cluster.workers[i]``, with
   that worker's speed emulated and its memory budget enforced by the plan);
2. profiles the model on one minibatch (``flotilla.pipeline.profiler``) and cuts it with
   ``fixed_stage_plan`` (bottleneck-minimising contiguous split for those devices); a split that
   does not fit in memory is refused with the partitioner's message;
3. hosts the rendezvous store, writes ``<run_dir>/pipeline_job.json`` and starts
   ``python -m flotilla.roles.stage`` once per stage (own session, dies with its
   parent); supervises them: the first stage that fails, or Ctrl-C, kills every stage; all are
   reaped before this returns or raises;
4. evaluates the assembled final model on the test split, writes ``summary.json``, the loss and
   throughput plots (``flotilla.report.metrics``), ``gantt.png`` (measured timeline of a window of
   steps) and ``gantt_modelled.png`` (the same schedule with the plan's modelled times), and returns
   the summary dict.

Layering: ``trainer`` may not import ``cli``, so the launcher's ``spawn`` and ``kill_all`` helpers
(and optionally its live progress display) are passed in by the caller, ``flotilla.launch.local``.
``train_single_process`` is the naive reference (one process, whole minibatches) the tests compare
the pipeline's losses with.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flotilla.comm.collective import StoreHost
from flotilla.config import RunConfig
from flotilla.core.atomic_io import atomic_write_json
from flotilla.core.errors import ConfigError, FlotillaError
from flotilla.core.log import get_logger
from flotilla.core.procs import Child
from flotilla.pipeline.plan import DeviceSpec, LinkModel, PartitionOptions, PipelinePlan
from flotilla.pipeline.profile import ModelProfile
from flotilla.pipeline.profiler import profile_model
from flotilla.pipeline.schedule import ScheduleKind, parse_action
from flotilla.pipeline.split import fixed_stage_plan, layer_ends_of, split_sequential
from flotilla.pipeline.timeline import modelled_timeline
from flotilla.report.gantt import render_gantt
from flotilla.report.metrics import make_plots, write_summary
from flotilla.roles.stage import job_schedule, job_steps, loss_fn, make_sampler
from flotilla.trainer import builders

__all__ = [
    "evaluate_model",
    "partition_options",
    "pipeline_devices",
    "plan_for_run",
    "profile_for_config",
    "run_pipeline_job",
    "train_single_process",
]

log = get_logger("pipeline-job")
SpawnFn = Callable[[list[str], Path], subprocess.Popen]


# ------------------------------------------------------------------------------ planning helpers


def pipeline_devices(cfg: RunConfig) -> list[DeviceSpec]:
    return [
        DeviceSpec(name=w.name, speed=w.speed, memory_bytes=w.memory_bytes)
        for w in cfg.cluster.resolved_workers()
    ]


def partition_options(cfg: RunConfig) -> PartitionOptions:
    """The partitioner's knobs for this run: schedule, microbatches, optimizer state per weight byte
    (weights + gradient + state: 2 for plain SGD, 3 with momentum, 4 for Adam)."""
    st, opt = cfg.strategy, cfg.job.optimizer
    kind = ScheduleKind(st.schedule)
    multiplier = 4.0 if opt.kind == "adam" else (3.0 if opt.momentum > 0 else 2.0)
    pipedream = kind is ScheduleKind.PIPEDREAM
    return PartitionOptions(
        schedule=kind,
        num_microbatches=1 if pipedream else st.num_microbatches,
        vertical_sync=pipedream and st.vertical_sync,
        optimizer_multiplier=multiplier,
    )


def profile_for_config(cfg: RunConfig, *, num_warmup: int = 1, num_repeats: int = 3) -> ModelProfile:
    """Profile the configured model on one minibatch of ``job.batch_size`` training samples."""
    torch.set_num_threads(1)
    data = builders.build_dataset(cfg)
    model = builders.build_model_for(cfg, data)
    if not isinstance(model, nn.Sequential):
        raise ConfigError(f"job.model.name: {cfg.job.model.name} is not an nn.Sequential")
    x, y = data.train_tensors()
    n = min(cfg.job.batch_size, int(x.shape[0]))
    return profile_model(
        model,
        x[:n],
        lambda out: loss_fn(out, y[:n]),
        num_warmup=num_warmup,
        num_repeats=num_repeats,
        device_name="cpu (1 thread)",
    )


def plan_for_run(cfg: RunConfig, profile: ModelProfile) -> PipelinePlan:
    """The split ``flotilla run`` uses: stage i on ``cluster.workers[i]`` (see module docstring)."""
    devices = pipeline_devices(cfg)
    if len(devices) != cfg.strategy.num_stages:
        raise ConfigError(
            f"strategy.num_stages ({cfg.strategy.num_stages}) must equal the number of cluster "
            f"workers ({len(devices)}): stage i runs on cluster.workers[i]"
        )
    if cfg.strategy.num_stages > profile.num_layers:
        raise ConfigError(
            f"strategy.num_stages ({cfg.strategy.num_stages}) must be <= the model's "
            f"{profile.num_layers} layers"
        )
    return fixed_stage_plan(profile, devices, LinkModel(), partition_options(cfg))


# ------------------------------------------------------------------------------ evaluation, reference


@torch.no_grad()
def evaluate_model(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 256) -> dict[str, float]:
    """Mean loss and accuracy over every target (per position for the LM)."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for i in range(0, int(x.shape[0]), batch):
        out, target = model(x[i : i + batch]), y[i : i + batch]
        loss_sum += float(nn.functional.cross_entropy(out, target, reduction="sum"))
        correct += int((out.argmax(dim=1) == target).sum())
        count += target.numel()
    model.train()
    return {"loss": loss_sum / max(1, count), "accuracy": correct / max(1, count)}


def train_single_process(cfg: RunConfig, num_steps: int | None = None) -> list[float]:
    """Naive reference: the same model, data order and optimizer in one process, whole minibatches;
    returns the training loss of every step."""
    torch.set_num_threads(1)
    data = builders.build_dataset(cfg)
    x, y = data.train_tensors()
    model = builders.build_model_for(cfg, data)
    opt = builders.build_optimizer(cfg, model)
    sampler = make_sampler(cfg, int(x.shape[0]))
    losses = []
    for k in range(num_steps if num_steps is not None else job_steps(cfg, sampler)):
        idx = torch.from_numpy(sampler.global_batch(k))
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


# ------------------------------------------------------------------------------ the job


def run_pipeline_job(
    cfg: RunConfig,
    report_dir: Path | None,
    run_dir: Path | None,
    progress: bool = True,
    *,
    spawn: SpawnFn,
    kill_all: Callable[..., None],
    make_progress: Callable[[bool, int], ContextManager[Any]] | None = None,
) -> dict:
    """Run a pipeline job to completion; returns the summary (see the module docstring)."""
    if cfg.strategy.kind != "pipeline":
        raise ConfigError(f"strategy.kind must be 'pipeline' for run_pipeline_job, got {cfg.strategy.kind!r}")
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="flotilla-pipeline-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    if report_dir is not None:
        Path(report_dir).mkdir(parents=True, exist_ok=True)
    profile = profile_for_config(cfg, num_warmup=1, num_repeats=2)
    plan = plan_for_run(cfg, profile)
    data = builders.build_dataset(cfg)
    num_steps = job_steps(cfg, make_sampler(cfg, data.num_train))
    schedule = job_schedule(cfg, num_steps)
    workers = cfg.cluster.resolved_workers()
    store = StoreHost("127.0.0.1", 0, timeout_s=cfg.strategy.step_timeout_s)
    job = {
        "config": cfg.to_dict(),
        "store": {"host": store.address.host, "port": store.address.port},
        "layer_ends": list(layer_ends_of(plan)),
        "stage_names": [w.name for w in workers],
        "speeds": [w.speed for w in workers],
        "total_steps": num_steps,
        "run_dir": str(run_dir),
        "report_dir": str(report_dir) if report_dir is not None else None,
    }
    job_path = run_dir / "pipeline_job.json"
    atomic_write_json(job_path, job)
    children: list[Child] = []
    start = time.perf_counter()
    try:
        for i, w in enumerate(workers):
            log_path = run_dir / f"stage{i}.log"
            cmd = [sys.executable, "-m", "flotilla.roles.stage", "--job", str(job_path), "--stage", str(i)]
            children.append(Child(name=w.name, proc=spawn(cmd, log_path), log_path=log_path))
        factory = make_progress or _plain_progress
        with factory(progress, num_steps) as display:
            _supervise(children, run_dir, workers, display, start)
    finally:
        kill_all(children, grace_s=0.0)  # on success every stage has exited already: this only reaps
        store.close()
    job_wall_s = time.perf_counter() - start
    return _finish(cfg, plan, schedule, profile, job, run_dir, report_dir, job_wall_s)


def _supervise(children: list[Child], run_dir: Path, workers: list, display: Any, start: float) -> None:
    while True:
        codes = [c.proc.poll() for c in children]
        for c, rc in zip(children, codes):
            if rc not in (None, 0):
                tail = c.log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise FlotillaError(f"pipeline stage {c.name} exited with code {rc}: {' | '.join(tail)}")
        if display is not None:
            display.update(_snapshot(run_dir, workers, start))
        if all(rc == 0 for rc in codes):
            return
        time.sleep(0.2)


def _snapshot(run_dir: Path, workers: list, start: float) -> dict:
    """A progress snapshot in the coordinator's format, from the stages' status files."""
    rows = []
    for i, w in enumerate(workers):
        try:
            st = json.loads((run_dir / f"stage{i}.status.json").read_text())
        except (OSError, ValueError):
            st = {"step": 0, "loss": None, "state": "starting", "samples_per_s": 0.0}
        loss = st["loss"] if st["loss"] is not None else math.nan
        state = "training" if st["state"] in ("training", "done") else st["state"]
        rows.append(
            {
                "name": w.name,
                "worker_id": i,
                "speed": w.speed,
                "state": state,
                "step": st["step"],
                "samples_per_s": st["samples_per_s"] if i == 0 else 0.0,
                "loss": loss,
                "membership_epoch": 1,
            }
        )
    return {
        "workers": rows,
        "evals": [],
        "members": [w.name for w in workers],
        "epoch": 1,
        "elapsed_s": time.perf_counter() - start,
    }


class _PlainProgress:
    """One stderr line every 5 s (used when the caller gives no live display)."""

    def __init__(self, enabled: bool, total_steps: int) -> None:
        self.enabled, self.total, self.last = enabled, total_steps, 0.0

    def update(self, snap: dict) -> None:
        if self.enabled and time.monotonic() - self.last >= 5.0:
            self.last = time.monotonic()
            last = snap["workers"][-1]
            print(
                f"pipeline: step {last['step']}/{self.total} loss {last['loss']:.4f} "
                f"{snap['elapsed_s']:.0f}s",
                file=sys.stderr,
                flush=True,
            )


def _plain_progress(enabled: bool, total_steps: int) -> ContextManager[Any]:
    return contextlib.nullcontext(_PlainProgress(enabled, total_steps))


# ------------------------------------------------------------------------------ reports


def _finish(
    cfg: RunConfig,
    plan: PipelinePlan,
    schedule: Any,
    profile: ModelProfile,
    job: dict,
    run_dir: Path,
    report_dir: Path | None,
    job_wall_s: float,
) -> dict:
    p = len(job["layer_ends"])
    stages = [json.loads((run_dir / f"stage{i}.json").read_text()) for i in range(p)]
    data = builders.build_dataset(cfg)
    model = builders.build_model_for(cfg, data)
    for i, module in enumerate(split_sequential(model, job["layer_ends"])):
        module.load_state_dict(torch.load(run_dir / f"stage{i}.pt", weights_only=True))
    evaluation = evaluate_model(model, *data.test_tensors())
    losses = [float(v) for _, v in sorted(stages[-1]["step_losses"].items(), key=lambda kv: int(kv[0]))]
    wall_s = max(s["wall_s"] for s in stages)
    steps = schedule.num_minibatches
    out_dir = Path(report_dir) if report_dir is not None else run_dir
    gantt = _gantt(stages, schedule, out_dir / "gantt.png")
    modelled = _modelled_gantt(plan, profile, schedule, cfg, out_dir / "gantt_modelled.png")
    tail = losses[-max(1, min(10, len(losses) // 5)) :]
    summary = {
        "test_accuracy": evaluation["accuracy"],
        "test_loss": evaluation["loss"],
        "steps": steps,
        "wall_s": wall_s,
        "job_wall_s": job_wall_s,
        "samples_per_s": steps * cfg.job.batch_size / wall_s,
        "num_workers": p,
        "num_workers_started": p,
        "membership_epochs": 1,
        "completed": True,
        "strategy": "pipeline",
        "schedule": schedule.kind.value,
        "num_microbatches": schedule.num_microbatches,
        "vertical_sync": schedule.vertical_sync,
        "layer_ends": job["layer_ends"],
        "first_train_loss": losses[0] if losses else None,
        "final_train_loss": sum(tail) / len(tail) if tail else None,
        "train_losses": losses,
        "measured_step_s": wall_s / steps,
        "predicted_step_s": plan.predicted_step_s,
        "plan": plan.to_dict(),
        "gantt": str(gantt),
        "gantt_modelled": str(modelled) if modelled else None,
        "workers": [
            {
                "name": n,
                "speed": sp,
                "state": "done",
                "step": steps,
                "samples_per_s": steps * cfg.job.batch_size / wall_s,
            }
            for n, sp in zip(job["stage_names"], job["speeds"])
        ],
        "stages": [
            {
                k: s[k]
                for k in (
                    "stage_idx",
                    "wall_s",
                    "compute_s",
                    "slept_s",
                    "peak_in_flight",
                    "peak_weight_copies",
                )
            }
            | {"name": job["stage_names"][i]}
            for i, s in enumerate(stages)
        ],
        "evals": [{"step": steps, "test_accuracy": evaluation["accuracy"], "test_loss": evaluation["loss"]}],
    }
    if report_dir is not None:
        write_summary(report_dir, summary)
        make_plots(report_dir)
    return summary


def _gantt(stages: list[dict], schedule: Any, path: Path) -> Path:
    entries = [(e[0], parse_action(e[1]), e[2], e[3]) for s in stages for e in s["timeline"]]
    lo, hi = stages[0]["gantt_window"]
    title = (
        f"measured: {schedule.kind.value}, {schedule.num_stages} stages, "
        f"{schedule.num_microbatches} microbatch(es)/step, steps {lo}..{hi - 1}"
    )
    return render_gantt(entries, path, title=title, num_stages=schedule.num_stages)


def _modelled_gantt(
    plan: PipelinePlan, profile: ModelProfile, schedule: Any, cfg: RunConfig, path: Path
) -> Path | None:
    """The same kind of schedule over a few minibatches with the plan's per-microbatch times."""
    m, p = schedule.num_microbatches, schedule.num_stages
    speeds = [w.speed for w in cfg.cluster.resolved_workers()]
    fwd, bwd = [], []
    for st, speed in zip(plan.stages, speeds):
        layers = profile.layers[st.layer_start : st.layer_end]
        fwd.append(sum(x.forward_s for x in layers) / speed / m)
        bwd.append(sum(x.backward_s for x in layers) / speed / m)
    comm = [st.comm_s / 2 / m for st in plan.stages[:-1]]
    small = job_schedule(cfg, min(schedule.num_minibatches, 2 if schedule.kind.flushes else 3 * p + 2))
    timeline = modelled_timeline(small, fwd, bwd, comm)
    return render_gantt(
        timeline, path, title=f"modelled: {schedule.kind.value}, {p} stages (plan times)", num_stages=p
    )
