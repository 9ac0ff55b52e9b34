"""One pipeline stage process: ``python -m flotilla.roles.stage --job JOB.json --stage I``.

The launcher (``flotilla.launch.pipeline``) writes ``JOB.json`` (the validated run
configuration, the store address, the layer cut points, the stage names and speeds, output
directories) and starts one process per stage.  Each stage:

1. builds the job's task (``trainer.pipeline_setup.pipeline_parts``: the task's data and its
   model, seeded with ``job.seed`` everywhere, so every stage holds identical initial weights) and
   the whole job's schedule; keeps only its own layers; on a resume (``job["resume"]``) loads its
   checkpoint of the resume step and runs the remaining steps;
2. joins the stage group (``EpochGroup``, epoch 1, rank = stage index) through the store;
3. runs ``StageRuntime`` over its action list with speed emulation (``SpeedEmulator``), appending
   one metrics record per step to ``metrics.jsonl`` (the loss only on the last stage) and a status
   file for the launcher's progress display; with ``job["checkpoint"]``, writes its part of the
   job's checkpoint every ``every_steps`` steps (``flotilla.trainer.pipeline_checkpoint``);
4. writes ``stage<I>.safetensors`` (its final weights) and ``stage<I>.json`` (timeline window for
   the Gantt chart, peaks, emulation figures, losses), then exits 0.  Any error exits non-zero;
   the launcher then kills every stage.

The job's setup (task, sampler, schedule, microbatch data, the task's loss) is
``flotilla.trainer.pipeline_setup``, shared with the launcher and the single-process reference;
which timeline entries are kept for the Gantt chart is ``flotilla.report.gantt.gantt_window``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from flotilla.cluster.emulation import SpeedEmulator
from flotilla.comm.collective import EpochGroup, StoreAddress, connect_store
from flotilla.config import validate_config
from flotilla.core.atomic_io import atomic_write_json
from flotilla.core.log import get_logger, setup_logging
from flotilla.core.threads import use_torch_threads
from flotilla.data.sampler import GlobalBatchSampler
from flotilla.elastic.checkpoint import export_model
from flotilla.pipeline.runtime import RuntimeOptions, StageResult, StageRuntime
from flotilla.pipeline.schedule import Schedule, format_action
from flotilla.pipeline.split import boundary_specs, split_sequential
from flotilla.report.gantt import entry_step, gantt_window
from flotilla.report.metrics import MetricsWriter
from flotilla.trainer import builders
from flotilla.trainer.pipeline_checkpoint import StageCheckpointer, load_stage, restore_stage
from flotilla.trainer.pipeline_setup import (
    BatchData,
    job_schedule,
    make_sampler,
    pipeline_parts,
    pipeline_strategy,
)

log = get_logger("pipeline-stage")


class _Reporter:
    """Per-step metrics records and the status file the launcher polls."""

    def __init__(
        self, job: dict, stage_idx: int, sampler: GlobalBatchSampler, last: bool, first_step: int = 0
    ) -> None:
        self.name, self.stage_idx, self.sampler, self.last = (
            job["stage_names"][stage_idx],
            stage_idx,
            sampler,
            last,
        )
        self.first_step = first_step  # steps done before this process started (a resume)
        self.after_step: list = []  # more callbacks (step, loss) for each completed step
        self.status_path = Path(job["run_dir"]) / f"stage{stage_idx}.status.json"
        self.writer = MetricsWriter(job["report_dir"]) if job.get("report_dir") else None
        self.start = time.perf_counter()
        self.samples, self.last_status = 0, 0.0
        crash = os.environ.get("FLOTILLA_FAULT_CRASH", "")  # test hook: "STAGE_NAME@STEP"
        self.crash_at = int(crash.partition("@")[2]) if crash.partition("@")[0] == self.name else None

    def __call__(self, local_step: int, loss: float | None, samples: int) -> None:
        step = self.first_step + local_step
        if self.crash_at is not None and step + 1 >= self.crash_at:
            log.error("fault injection: stage %s crashing after step %d", self.name, step + 1)
            os._exit(17)
        self.samples += samples
        if self.writer is not None:
            self.writer.write(
                {
                    "time_s": time.time(),
                    "worker_id": self.name,
                    "step": step + 1,
                    "loss": loss,
                    "samples": samples,
                    "epoch": self.sampler.data_epoch(step),
                    "membership_epoch": 1,
                    "stage_idx": self.stage_idx,
                }
            )
        for callback in self.after_step:
            callback(step, loss)
        now = time.perf_counter()
        if now - self.last_status >= 0.5:
            self.status(step + 1, loss, "training")
            self.last_status = now

    def status(self, step: int, loss: float | None, state: str) -> None:
        elapsed = time.perf_counter() - self.start
        atomic_write_json(
            self.status_path,
            {
                "step": step,
                "loss": loss,
                "state": state,
                "samples_per_s": self.samples / elapsed if elapsed > 0 else 0.0,
            },
        )

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _result_json(
    res: StageResult, schedule: Schedule, window: tuple[int, int], emulator: SpeedEmulator
) -> dict:
    lo, hi = window
    entries = [
        [e.stage_idx, format_action(e.action), e.start_s, e.end_s]
        for e in res.timeline
        if lo <= entry_step(schedule, e.action) < hi
    ]
    return {
        "stage_idx": res.stage_idx,
        "wall_s": res.wall_s,
        "compute_s": emulator.compute_s,
        "slept_s": emulator.slept_s,
        "peak_in_flight": res.peak_in_flight,
        "peak_weight_copies": res.peak_weight_copies,
        "peak_activation_bytes": res.peak_activation_bytes,
        "step_losses": {str(k): v for k, v in sorted(res.step_losses.items())},
        "gantt_window": [lo, hi],
        "timeline": entries,
    }


def _checkpointer(job: dict, stage_idx: int) -> StageCheckpointer | None:
    ck = job.get("checkpoint")
    if not ck:
        return None
    return StageCheckpointer(
        root=Path(ck["root"]),
        stage_idx=stage_idx,
        every_steps=int(ck["every_steps"]),
        keep=int(ck["keep"]),
        fingerprint=str(ck["fingerprint"]),
        layer_ends=[int(e) for e in job["layer_ends"]],
    )


def run_stage(job: dict, stage_idx: int) -> None:
    """Everything one stage process does (see the module docstring)."""
    cfg = validate_config(job["config"])
    use_torch_threads()
    parts = pipeline_parts(cfg)
    model = parts.model
    ends = [int(e) for e in job["layer_ends"]]
    stage = split_sequential(model, ends)[stage_idx]
    specs = boundary_specs(model, parts.train.batch([0])[0], ends)
    sampler = make_sampler(cfg, parts.train.num_samples)
    resume = job.get("resume") or None
    first_step = int(resume["step"]) if resume else 0
    schedule = job_schedule(cfg, int(job["total_steps"]) - first_step)
    p = len(ends)
    emulator = SpeedEmulator(float(job["speeds"][stage_idx]))
    reporter = _Reporter(job, stage_idx, sampler, stage_idx == p - 1, first_step)
    optimizer = builders.build_optimizer(cfg, stage)
    losses: list[float] = []
    if resume:
        ckpt = load_stage(Path(resume["dir"]), stage_idx, first_step, str(resume["fingerprint"]))
        losses = restore_stage(ckpt, stage, optimizer)
    checkpointer = _checkpointer(job, stage_idx)
    if checkpointer is not None:
        checkpointer.losses = list(losses)
        reporter.after_step.append(lambda step, loss: checkpointer.after_step(step, loss, stage, optimizer))
    store = connect_store(StoreAddress(job["store"]["host"], int(job["store"]["port"])))
    group = EpochGroup(
        store, epoch=1, rank=stage_idx, world_size=p, timeout_s=pipeline_strategy(cfg).step_timeout_s
    )
    try:
        runtime = StageRuntime(
            stage,
            optimizer,
            stage_idx=stage_idx,
            group=group,
            data=BatchData(parts.train, sampler, schedule.num_microbatches, first_step),
            loss_fn=parts.task.loss,
            in_spec=specs[stage_idx - 1] if stage_idx > 0 else None,
            out_spec=specs[stage_idx] if stage_idx < p - 1 else None,
            options=RuntimeOptions(),
            emulator=emulator,
        )
        runtime.on_step = reporter
        reporter.status(first_step, None, "training")
        group.barrier()  # start together: the measured wall time is training, not start-up skew
        result = runtime.run(schedule)
        group.barrier()  # every stage finished: nobody tears the group down under a peer
    finally:
        group.close()
        reporter.close()
    step_losses = result.step_losses
    last_loss = step_losses.get(max(step_losses)) if step_losses else None
    reporter.status(int(job["total_steps"]), last_loss, "done")
    run_dir = Path(job["run_dir"])
    export_model(run_dir / f"stage{stage_idx}.safetensors", stage.state_dict())
    out = _result_json(result, schedule, gantt_window(schedule), emulator)
    history = {str(k): v for k, v in enumerate(losses)} if stage_idx == p - 1 else {}
    out["step_losses"] = history | {str(first_step + int(k)): v for k, v in out["step_losses"].items()}
    out["first_step"] = first_step
    atomic_write_json(run_dir / f"stage{stage_idx}.json", out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one pipeline stage of a flotilla job.")
    parser.add_argument("--job", required=True, type=Path, help="JSON job file written by the launcher")
    parser.add_argument("--stage", required=True, type=int, help="stage index")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    setup_logging(f"stage {args.stage}", args.log_level)
    job = json.loads(args.job.read_text())
    if not 0 <= args.stage < len(job["layer_ends"]):
        log.error("stage %d out of range", args.stage)
        return 2
    t0 = time.perf_counter()
    run_stage(job, args.stage)
    log.info("stage %d done in %.1f s", args.stage, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
