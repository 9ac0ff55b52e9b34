"""``flotilla run`` for ``strategy: {kind: pipeline}``: plan, one process per stage, reports.
This module assembles the parts (prepare, attempts, restarts, finish); each lives in its own.

``run_pipeline_job(cfg, report_dir, run_dir, progress, supervisor=..., resume_dir=...)``:

1. builds the job's task (``pipeline_setup.pipeline_parts``: an ``nn.Sequential``, a list of
   layers, or any module traced and cut at ``strategy.split_points``); a model that cannot be
   traced or cut there is one ConfigError line and nothing is started; checks
   that the cluster has one worker per stage (stage i runs on ``cluster.workers[i]``, with that
   worker's speed emulated and its memory budget enforced by the plan);
2. profiles the task's layers on one minibatch and cuts them (``profile_for_config``,
   ``plan_for_run``); a split that does not fit in memory is refused with the partitioner's
   message.  With ``resume_dir`` (a pipeline checkpoint directory) the newest step every stage
   checkpointed is verified first and its split is kept (``pipeline_checkpoint.resume_point``),
   or re-planned when the job has another number of stages or other split points (the stages
   then re-partition the checkpointed state: ``pipeline_checkpoint.restore_reshaped``);
   with ``checkpoint`` configured the stages write per-stage checkpoints (flushing schedules only);
3. writes the cluster secret (``<run_dir>/secret``, the run directory made 0700) and runs the
   stages (``launch/pipeline_attempt.py``: a pipeline host, ``roles/stage_host.py``, and one
   ``flotilla worker --coordinator ... --name NAME`` stage worker per stage process through the
   run's ``Supervisor``: the path stages started by hand on other hosts take too); a stage that
   dies restarts every stage from the newest step all of them checkpointed
   (``pipeline_prepare.restart_point``; ``pipeline_watch.Restarts``: at most
   ``job.max_restarts``, only while the job progresses, each restart recorded with when and
   why); a failure that may not be restarted, or Ctrl-C,
   kills every stage and still writes ``summary.json`` (``completed: false``, ``error``); all
   are reaped before this returns or raises.  Stages that
   stop on a non-finite value (exit code 4, every stage at the same step) are waited for: their
   last finite weights are merged into ``model.safetensors`` and the stage's one line is raised
   (``FlotillaError``);
4. (``launch/pipeline_finish.py``) merges the stages' final weights back into the task's model,
   writes it as ``model.safetensors`` (a plain ``state_dict`` with the model's own key names,
   ``elastic.checkpoint.export_model``) in the report directory (else the run directory),
   evaluates it on the task's eval data
   (``task_load.evaluate_task``: ``test_loss`` and ``test_<metric>`` for every metric, the
   task's headline), writes ``summary.json`` (``flotilla.report.summary.pipeline_summary`` plus
   the absolute ``model_file``; ``evals``: the stages' periodic evaluations, then the final one,
   which is also appended to ``evals.jsonl``), the loss and throughput plots, ``gantt.png``
   (measured timeline of a window of steps) and ``gantt_modelled.png`` (the same schedule with
   the plan's modelled times), and returns the summary dict.  ``restarts`` lists every restart
   and ``degraded`` says what a completed run went through (None: no stage was restarted).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from flotilla.comm import shaping
from flotilla.comm.auth import read_secret_file
from flotilla.config import RunConfig
from flotilla.core.errors import FlotillaError
from flotilla.launch.pipeline_attempt import attempt, write_run_secret
from flotilla.launch.pipeline_finish import final_model, finish_pipeline
from flotilla.launch.pipeline_instance_log import InstanceLog
from flotilla.launch.pipeline_prepare import (
    _plan,
    host_context,
    place_context,
    prepare_pipeline,
    restart_point,
)
from flotilla.launch.pipeline_reform import Reformer
from flotilla.launch.pipeline_watch import Restarts, StageFailure, job_step_of, write_incomplete
from flotilla.launch.progress import Progress
from flotilla.launch.revocations import start_stage_revocations
from flotilla.launch.supervisor import Supervisor
from flotilla.launch.zygote_client import fork_allowed
from flotilla.pipeline.profile import scaled_profile
from flotilla.report.summary import write_reports
from flotilla.sync.stage_plug import lost_instances_return, stage_plug

__all__ = ["run_pipeline_job"]


def run_pipeline_job(
    cfg: RunConfig,
    report_dir: Path | None,
    run_dir: Path | None,
    progress: bool = True,
    *,
    supervisor: Supervisor | None = None,
    resume_dir: Path | None = None,
) -> dict[str, Any]:
    """Run a pipeline job to completion; returns the summary (see the module docstring).

    ``supervisor``: the run's supervisor (default: a new one for ``run_dir``); every stage it
    started has exited or been killed, and been reaped, when this returns or raises.
    ``resume_dir``: a pipeline checkpoint directory (``<checkpoint.dir>`` with ``stage<i>/``) to
    continue from.
    """
    with shaping.scoped(cfg.cluster.link_shaping("launcher")):  # (its servers' links: links.emulate)
        return _run_pipeline_job(cfg, report_dir, run_dir, progress, supervisor, resume_dir)


def _run_pipeline_job(
    cfg: RunConfig,
    report_dir: Path | None,
    run_dir: Path | None,
    progress: bool,
    supervisor: Supervisor | None,
    resume_dir: Path | None,
) -> dict[str, Any]:
    prep = prepare_pipeline(cfg, report_dir, run_dir, resume_dir)
    parts, profile, plan, resume, num_steps = prep.parts, prep.profile, prep.plan, prep.resume, prep.num_steps
    run_dir, report_dir, ck_plan = prep.run_dir, prep.report_dir, prep.ck_plan
    secret_file = write_run_secret(run_dir)  # (run_dir made 0700) the stages' key to the rendezvous store
    sup = supervisor if supervisor is not None else Supervisor(run_dir, fork=fork_allowed(cfg))
    restarts = Restarts(max_restarts=cfg.job.max_restarts if ck_plan is not None else 0)
    first_resume = resume
    history = InstanceLog()  # (pipeline instances lost and back, every attempt's)
    plug = stage_plug(cfg)  # what the strategy adds to the stages (sync/stage_plug.py)
    side = (  # (closed by the finally below)
        plug.host(
            host_context(
                cfg,
                prep,
                parts.model,
                read_secret_file(secret_file),
                prep.job(cfg, resume).replicas,
                resume_dir,
            )
        )
        if plug is not None
        else None
    )
    independent = plug is not None and plug.independent_instances
    # (a lost instance formed again on other devices: launch/pipeline_reform.py; the placement's
    # profile scaled to each share -- nothing measured then, and every share compared from one
    # measurement, as the simulator does)
    scaled = lambda share: scaled_profile(profile, share)
    reform = (
        Reformer(plug, replace(place_context(cfg, lambda: parts), profile_for=scaled), cfg.cluster.worker)
        if plug is not None and plug.reforms
        else None
    )
    driver = (  # (a revocation schedule: devices revoked and added; closed by the finally below)
        start_stage_revocations(
            cfg,
            supervisor=sup,
            arrive=reform.arrive,
            revoke=reform.revoke,
            job_step=lambda: job_step_of(run_dir),
            steps=num_steps,
            log_path=prep.out_dir / "revocations.jsonl",
        )
        if reform is not None
        else None
    )
    if reform is not None and driver is not None:
        reform.pending = driver.adds_pending  # (an instance waiting for devices keeps the job on)
    start = time.perf_counter()
    try:
        with Progress(enabled=progress, total_steps=num_steps) as display:
            while True:
                job = prep.job(cfg, resume, plan)
                if side is not None:
                    job = replace(job, services=side.services)
                if reform is not None:
                    reform.reset()  # (every attempt starts on the placement's devices)
                try:
                    end = attempt(
                        sup,
                        cfg,
                        job,
                        display,
                        start,
                        restarts,
                        history,
                        on_lost=side.lost if side is not None else None,
                        bring_back=lost_instances_return(plug),
                        alone=independent,
                        reform=reform,
                    )
                    break
                except StageFailure as failure:
                    resume = restart_point(cfg, failure, restarts, ck_plan, num_steps, run_dir)
                    plan = _plan(cfg, profile, resume) if resume else plan
        job = end.job  # (with the instances formed again on other processes)
        if reform is not None and reform.formed:  # (their own devices and cuts)
            placed = list(prep.instances)
            for k, formed in reform.formed.items():
                placed[k] = formed
            prep = replace(prep, instances=tuple(placed))
        lead = end.instances.lead  # (the lowest surviving pipeline instance: its weights)
        if end.stopped:  # (a non-finite value: the last finite weights are kept, the run is incomplete)
            out = prep.out_dir / "model.safetensors"
            state = side.final_state() if side is not None else None
            final_model(cfg, parts, run_dir, job, out, lead, state)
            raise FlotillaError(f"{end.stopped}; {prep.out_dir / 'model.safetensors'} holds them")
        job_wall_s = time.perf_counter() - start
        alive = end.instances.generation.instances  # (in order: the lead first)
        if independent:  # (the lead: one that trained from the start, if any did)
            back = {e["instance"] for e in history.returned}
            alive = tuple(sorted(alive, key=lambda i: (i in back, i)))
        summary = finish_pipeline(cfg, prep, plan, job, job_wall_s, first_resume, alive, side)
        if prep.placement is not None:  # (the instances the strategy placed: VWs, devices, cuts)
            summary["placement"] = prep.placement
    except (FlotillaError, KeyboardInterrupt) as exc:
        why = str(exc) if isinstance(exc, FlotillaError) else "interrupted (Ctrl-C)"
        processes = prep.job(cfg, resume).num_processes
        extra = {"placement": prep.placement} if prep.placement is not None else None
        write_incomplete(report_dir, run_dir, processes, restarts, why, time.perf_counter() - start, extra)
        raise
    finally:
        if driver is not None:
            driver.close()
        if side is not None:
            side.close()
        if supervisor is None:  # (its own: whatever still runs is killed, its zygote ended)
            sup.close()
    # every restart with when and why; a run that restarted is complete, and says what it went through
    degraded = [n for n in (restarts.degraded_note(), history.note()) if n]
    summary.update(
        restarts=restarts.records,
        instances_lost=history.lost,
        instances_back=history.returned,
        instances_regrouped=history.regrouped,  # (a group broke with every instance alive)
        instances_reformed=reform.records if reform is not None else [],  # (on other devices)
        instances_not_reformed=[  # (lost, and no group of the devices left could hold them: why)
            {"instance": k, "why": why} for k, why in sorted(reform.waiting.items())
        ]
        if reform is not None
        else [],
        degraded="; ".join(degraded) if degraded else None,
    )
    if driver is not None:  # (what the schedule did; the VWs it cost: instances_lost / _reformed)
        done = driver.executed
        summary["revocations"] = {a: sum(e["action"] == a for e in done) for a in ("kill", "stop", "add")}
    if report_dir is not None:
        write_reports(report_dir, summary)
    return summary
