"""The end of a pipeline job, from its stages' result files: the lead instance's final weights
merged back into the user's model (``model.safetensors``), the final evaluation, the Gantt charts
and ``summary.json`` (step 4 of ``launch/pipeline.py``'s module doc).  Shared by ``flotilla run``
and ``flotilla coordinator`` (``launch/pipeline_host.py``)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from flotilla.config import RunConfig
from flotilla.core.errors import FlotillaError
from flotilla.elastic.checkpoint import export_model
from flotilla.launch.pipeline_prepare import PreparedPipeline
from flotilla.pipeline.plan import PipelinePlan
from flotilla.pipeline.split import split_sequential
from flotilla.report.gantt import measured_gantt, modelled_gantt
from flotilla.report.headline import headline_of
from flotilla.report.metrics import EVALS_FILE, REQUIRED_EVAL_KEYS, MetricsWriter
from flotilla.report.summary import pipeline_summary
from flotilla.sync.stage_plug import HostSide, stage_plug
from flotilla.trainer import builders
from flotilla.trainer.pipeline_job import ResumePoint, StageJob
from flotilla.trainer.pipeline_setup import (
    PipelineParts,
    as_module,
    job_schedule,
    pipeline_cluster,
    sequential_model,
)
from flotilla.trainer.task_load import evaluate_task

__all__ = ["final_model", "finish_pipeline"]


def final_model(
    cfg: RunConfig,
    parts: PipelineParts,
    run_dir: Path,
    job: StageJob,
    out: Path,
    lead: int = 0,
    state: Mapping[str, torch.Tensor] | None = None,
) -> nn.Module:
    """The stages' final weights (pipeline instance ``lead``'s) merged into a fresh task model
    (the user's own module), exported to ``out``; ``state``: the parameters the job ended with
    where they live elsewhere (by the layers' names: e.g. hetpipe's parameter servers), put over
    the lead's (whose buffers stay)."""
    built = as_module(builders.build_task_model(cfg, parts.task))
    layers = sequential_model(cfg, built)
    first = job.layout.first(lead)
    for i, module in enumerate(split_sequential(layers, list(job.ends_of(lead)))):
        module.load_state_dict(load_file(str(run_dir / f"stage{first + i}.safetensors")), strict=True)
    if state is not None:
        params = dict(layers.named_parameters())
        if set(state) != set(params):
            raise FlotillaError(
                f"the job's final parameters name {len(state)} tensors, the model {len(params)}"
            )
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)
    model: nn.Module = built  # (the layers share its parameters)
    export_model(out, model.state_dict())
    return model


def _instance_gantts(
    cfg: RunConfig, prep: PreparedPipeline, job: StageJob, stages: Mapping[int, dict[str, Any]], out_dir: Path
) -> dict[int, Path]:
    """One measured Gantt chart per surviving instance (``gantt_instance<K>.png``; ``stages``: the
    result files read, by stage process) where the instances run independently of each other
    (``sync/stage_plug.py``: HetPipe's virtual workers, each at its own pace); none where they
    flush together (one chart shows them all)."""
    plug = stage_plug(cfg)
    if plug is None or not plug.independent_instances:
        return {}
    layout, out = job.layout, {}
    for k in sorted({layout.instance_of(g) for g in stages}):
        files = [stages[g] for g in layout.processes(k)]
        schedule = job_schedule(cfg, prep.num_steps, layout.counts[k])
        out[k] = measured_gantt(files, schedule, out_dir / f"gantt_instance{k}.png")
    return out


def finish_pipeline(
    cfg: RunConfig,
    prep: PreparedPipeline,
    plan: PipelinePlan,
    job: StageJob,
    job_wall_s: float,
    resumed: ResumePoint | None,
    alive: tuple[int, ...],
    plug: HostSide | None = None,
) -> dict[str, Any]:
    """Step 4 of the module doc, from the stage files in ``job.run_dir``: the surviving pipeline
    instances ``alive`` (the lead first) -- the lead's weights, the figures of all.  ``plug``:
    the strategy's launcher side (``sync/stage_plug.py``): the final parameters and the summary's
    extra fields are its."""
    parts, schedule, profile = prep.parts, prep.schedule, prep.profile
    run_dir, report_dir, layout = job.run_dir, job.report_dir, job.layout
    processes = [g for r in alive for g in layout.processes(r)]
    stages = [json.loads((run_dir / f"stage{g}.json").read_text()) for g in processes]
    first = stages[: layout.counts[alive[0]]]  # (the lead instance: the Gantt charts, the evaluations)
    out_dir = report_dir if report_dir is not None else run_dir
    model_file = out_dir / "model.safetensors"
    state = plug.final_state() if plug is not None else None
    model = final_model(cfg, parts, run_dir, job, model_file, alive[0], state)
    evaluation = evaluate_task(parts.task, model, parts.eval)
    if prep.instances:  # (a placed instance: its own stage count and cut)
        schedule = job_schedule(cfg, prep.num_steps, layout.counts[alive[0]])
        plan = prep.instances[alive[0]].plan
    gantt = measured_gantt(first, schedule, out_dir / "gantt.png")
    by_process = dict(zip(processes, stages, strict=True))
    per_instance = _instance_gantts(cfg, prep, job, by_process, out_dir) if len(alive) > 1 else {}
    p = schedule.num_stages
    small = job_schedule(cfg, min(schedule.num_minibatches, 2 if schedule.kind.flushes else 3 * p + 2), p)
    speeds = (  # (per position: pipeline/replicas.py; a placed instance: its own devices')
        [cfg.cluster.worker(s.devices[0]).speed for s in plan.stages]
        if prep.instances
        else [d.speed for d in pipeline_cluster(cfg).devices]
    )
    modelled = modelled_gantt(plan, profile, small, speeds, out_dir / "gantt_modelled.png")
    summary = pipeline_summary(
        job=job.to_dict(),
        stages=stages,
        processes=processes,
        schedule=schedule,
        plan=plan,
        evaluation=evaluation,
        job_wall_s=job_wall_s,
        gantt=gantt,
        gantt_modelled=modelled,
        headline=headline_of(parts.task, [k for k, v in evaluation.items() if v is not None]),
        plans={k: i.plan for k, i in enumerate(prep.instances)} if prep.instances else None,
    )
    final = {"kind": "eval", "time_s": time.time(), **summary["evals"][-1]}
    summary["evals"] = [*first[-1].get("evals", []), final]  # the periodic ones, then the final one
    summary["model_file"] = str(model_file)
    if per_instance:  # (independent instances: each one's own timeline, by instance)
        summary["gantt_instances"] = {str(k): str(v) for k, v in per_instance.items()}
    if plug is not None:
        summary.update(plug.summary(stages))
    if resumed is not None:
        summary["resumed_from_step"] = resumed.step
    if report_dir is not None:  # (the caller writes the summary)
        with MetricsWriter(report_dir, filename=EVALS_FILE, required=REQUIRED_EVAL_KEYS) as writer:
            writer.write(final)
    return summary
