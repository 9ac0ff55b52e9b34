"""``flotilla run`` for ``strategy.kind == "pipeline"``: plan, one process per stage, reports.

``run_pipeline_job(cfg, report_dir, run_dir, progress, supervisor=...)``:

1. checks that the cluster has one worker per stage (stage i runs on ``cluster.workers[i]``, with
   that worker's speed emulated and its memory budget enforced by the plan);
2. profiles the model on one minibatch and cuts it (``flotilla.trainer.pipeline_setup``:
   ``profile_for_config``, ``plan_for_run``); a split that does not fit in memory is refused with
   the partitioner's message;
3. hosts the rendezvous store, writes ``<run_dir>/pipeline_job.json`` and starts
   ``python -m flotilla.roles.stage`` once per stage through the run's ``Supervisor`` (own
   session, dies with its parent); the first stage that fails, or Ctrl-C, kills every stage; all
   are reaped before this returns or raises;
4. evaluates the assembled final model on the test split (``trainer.builders.evaluate``), writes
   ``summary.json`` (``flotilla.report.summary.pipeline_summary``), the loss and throughput plots,
   ``gantt.png`` (measured timeline of a window of steps) and ``gantt_modelled.png`` (the same
   schedule with the plan's modelled times), and returns the summary dict.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from flotilla.comm.collective import StoreHost
from flotilla.config import RunConfig, WorkerSpec
from flotilla.core.atomic_io import atomic_write_json
from flotilla.core.errors import FlotillaError
from flotilla.core.log import get_logger
from flotilla.launch.progress import Progress
from flotilla.launch.supervisor import Supervisor
from flotilla.pipeline.plan import PipelinePlan
from flotilla.pipeline.profile import ModelProfile
from flotilla.pipeline.schedule import Schedule
from flotilla.pipeline.split import layer_ends_of, split_sequential
from flotilla.report.gantt import measured_gantt, modelled_gantt
from flotilla.report.summary import pipeline_summary, write_reports
from flotilla.trainer import builders
from flotilla.trainer.pipeline_setup import (
    job_schedule,
    make_sampler,
    pipeline_strategy,
    plan_for_run,
    profile_for_config,
    sequential_model,
)

__all__ = ["run_pipeline_job"]

log = get_logger("pipeline-job")


def run_pipeline_job(
    cfg: RunConfig,
    report_dir: Path | None,
    run_dir: Path | None,
    progress: bool = True,
    *,
    supervisor: Supervisor | None = None,
) -> dict[str, Any]:
    """Run a pipeline job to completion; returns the summary (see the module docstring).

    ``supervisor``: the run's supervisor (default: a new one for ``run_dir``); every stage it
    started has exited or been killed, and been reaped, when this returns or raises.
    """
    pipeline_strategy(cfg)  # ConfigError for any other strategy
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="flotilla-pipeline-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    if report_dir is not None:
        Path(report_dir).mkdir(parents=True, exist_ok=True)
    profile = profile_for_config(cfg, num_warmup=1, num_repeats=2)
    plan = plan_for_run(cfg, profile)
    data = builders.build_dataset(cfg)
    num_steps = builders.total_steps(cfg, make_sampler(cfg, data.num_train))
    schedule = job_schedule(cfg, num_steps)
    store = StoreHost("127.0.0.1", 0, timeout_s=pipeline_strategy(cfg).step_timeout_s)
    job = _job_file(cfg, plan, store, num_steps, run_dir, report_dir)
    sup = supervisor if supervisor is not None else Supervisor(run_dir)
    start = time.perf_counter()
    try:
        _start_stages(sup, job, run_dir / "pipeline_job.json")
        with Progress(enabled=progress, total_steps=num_steps) as display:
            _supervise(sup, run_dir, cfg.cluster.resolved_workers(), display, start)
    finally:
        sup.stop("stage", grace_s=0.0)  # on success every stage has exited already: this only reaps
        store.close()
    job_wall_s = time.perf_counter() - start
    return _finish(cfg, plan, schedule, profile, job, report_dir, job_wall_s)


def _job_file(
    cfg: RunConfig,
    plan: PipelinePlan,
    store: StoreHost,
    num_steps: int,
    run_dir: Path,
    report_dir: Path | None,
) -> dict[str, Any]:
    """Write ``<run_dir>/pipeline_job.json`` (what every stage process reads) and return it."""
    workers = cfg.cluster.resolved_workers()
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
    atomic_write_json(run_dir / "pipeline_job.json", job)
    return job


def _start_stages(sup: Supervisor, job: dict[str, Any], job_path: Path) -> None:
    for i, name in enumerate(job["stage_names"]):
        cmd = [sys.executable, "-m", "flotilla.roles.stage", "--job", str(job_path), "--stage", str(i)]
        sup.spawn(name, cmd, role="stage", log_name=f"stage{i}")


def _supervise(
    sup: Supervisor, run_dir: Path, workers: list[WorkerSpec], display: Progress, start: float
) -> None:
    """Until every stage exited 0; FlotillaError naming the first stage that exits otherwise."""
    while True:
        finished = not sup.alive("stage")  # before reaping: a stage that exits now is seen below
        for c in sup.reap():
            if c.returncode != 0:
                raise FlotillaError(
                    f"pipeline stage {c.name} exited with code {c.returncode}: {c.log_tail()}"
                )
        display.update(_snapshot(run_dir, workers, start))
        if finished:
            return
        time.sleep(0.2)


def _snapshot(run_dir: Path, workers: list[WorkerSpec], start: float) -> dict[str, Any]:
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


def _evaluate_final(cfg: RunConfig, run_dir: Path, layer_ends: list[int]) -> dict[str, float]:
    """The stages' final weights assembled into one model, evaluated on the test split."""
    data = builders.build_dataset(cfg)
    model = sequential_model(cfg, builders.build_model_for(cfg, data))
    for i, module in enumerate(split_sequential(model, layer_ends)):
        module.load_state_dict(torch.load(run_dir / f"stage{i}.pt", weights_only=True))
    return builders.evaluate(model, *data.test_tensors())


def _finish(
    cfg: RunConfig,
    plan: PipelinePlan,
    schedule: Schedule,
    profile: ModelProfile,
    job: dict[str, Any],
    report_dir: Path | None,
    job_wall_s: float,
) -> dict[str, Any]:
    run_dir = Path(job["run_dir"])
    stages = [json.loads((run_dir / f"stage{i}.json").read_text()) for i in range(len(job["layer_ends"]))]
    out_dir = Path(report_dir) if report_dir is not None else run_dir
    gantt = measured_gantt(stages, schedule, out_dir / "gantt.png")
    p = schedule.num_stages
    small = job_schedule(cfg, min(schedule.num_minibatches, 2 if schedule.kind.flushes else 3 * p + 2))
    modelled = modelled_gantt(plan, profile, small, job["speeds"], out_dir / "gantt_modelled.png")
    summary = pipeline_summary(
        job=job,
        stages=stages,
        schedule=schedule,
        plan=plan,
        evaluation=_evaluate_final(cfg, run_dir, job["layer_ends"]),
        job_wall_s=job_wall_s,
        gantt=gantt,
        gantt_modelled=modelled,
    )
    if report_dir is not None:
        write_reports(report_dir, summary)
    return summary
