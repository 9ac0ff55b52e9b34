"""The run summary (``summary.json``): assembled from what a run produced, validated, written.

- ``run_summary`` builds the summary of a data-parallel run (``allreduce`` or ``ps``) from the
  coordinator's final snapshot; ``pipeline_summary`` builds a pipeline run's from the stages'
  result files, the plan and the final evaluation.  Both are pure (dicts in, a dict out).
- ``write_summary`` writes ``<report_dir>/summary.json`` atomically and refuses a summary without
  ``REQUIRED_SUMMARY_KEYS``, without a ``headline`` key (None: the run never evaluated) or a
  ``test_accuracy``, or with a ``test_accuracy`` outside [0, 1];
- ``write_reports`` writes the summary and the plots of ``flotilla.report.plots``.

Evaluation fields (``flotilla.report.headline``): every ``test_<name>`` of the final evaluation,
``headline``/``headline_mode`` naming the one shown first; ``test_accuracy`` only for a task with
an accuracy metric; ``test_loss`` always (None when the run never evaluated).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flotilla.core.atomic_io import atomic_write_json
from flotilla.pipeline.layout import Layout
from flotilla.pipeline.plan import PipelinePlan
from flotilla.pipeline.schedule import Schedule
from flotilla.report.headline import (
    HEADLINE,
    HEADLINE_MODE,
    Headline,
    headline_from_record,
    headline_of,
    normalize_eval,
)
from flotilla.report.membership import membership_plot, recovery_summary
from flotilla.report.metrics import REQUIRED_SUMMARY_KEYS, SUMMARY_FILE, require_keys, to_jsonable
from flotilla.report.plots import make_plots

__all__ = ["degraded_note", "pipeline_summary", "run_summary", "worker_row", "write_reports", "write_summary"]

_STAGE_KEYS = ("stage_idx", "wall_s", "compute_s", "slept_s", "peak_in_flight", "peak_weight_copies")


def _memory_row(measured: Mapping[str, Any] | None, plan: PipelinePlan, stage: int) -> dict[str, Any] | None:
    """A stage's measured memory (``roles/stage_memory.py``) beside the plan's prediction."""
    if not measured:
        return None
    planned = plan.stages[stage]
    return dict(measured) | {
        "predicted_bytes": planned.memory_bytes,
        "predicted_activation_bytes": planned.activation_bytes,
    }


def write_summary(report_dir: str | Path, summary: Mapping[str, Any]) -> Path:
    """Write ``<report_dir>/summary.json`` atomically; ValueError names a missing required key."""
    require_keys(summary, REQUIRED_SUMMARY_KEYS, "summary")
    if HEADLINE not in summary and "test_accuracy" not in summary:
        raise ValueError(
            "summary names no headline metric: it needs 'headline' (None if the run never evaluated) "
            "or 'test_accuracy'"
        )
    acc = summary.get("test_accuracy")
    if acc is not None and not (isinstance(acc, (int, float)) and 0.0 <= float(acc) <= 1.0):
        raise ValueError(f"test_accuracy must be a number in [0, 1] or None, got {acc!r}")
    path = Path(report_dir) / SUMMARY_FILE
    atomic_write_json(path, to_jsonable(summary))
    return path


def write_reports(report_dir: Path, summary: Mapping[str, Any]) -> list[Path]:
    """``summary.json`` and the plots (loss, throughput, and the headline metric of the periodic
    evaluations; with revocations, the membership timeline and the recovery figures in the
    summary, ``report/membership.py``); returns the written paths."""
    # (a run with a revocation schedule; a runner that says what its revocations did keeps its own)
    revocations = recovery_summary(report_dir) if "revocations" not in summary else None
    if revocations is not None:
        summary = {**summary, "revocations": revocations}
    paths = [write_summary(report_dir, summary)]
    paths += make_plots(report_dir, headline=headline_from_record(summary))
    timeline = membership_plot(report_dir)
    return paths if timeline is None else [*paths, timeline]


def worker_row(w: Mapping[str, Any]) -> dict[str, Any]:
    """A worker's line of ``summary.json``: its mean throughput over the time it spent in steps
    (not the last step's), and its last clock under strategy ps."""
    row = {k: w[k] for k in ("name", "speed", "state", "step")}
    row["samples_per_s"] = w["samples"] / w["busy_s"] if w.get("busy_s") else 0.0
    for key in ("device", "transport"):
        if w.get(key):
            row[key] = w[key]
    if w.get("clock") is not None:
        row["clock"] = w["clock"]
    if w.get("first_clock"):  # (ps) it joined mid-run at this clock
        row["joined_at_clock"] = w["first_clock"]
    return row


def _steps(final: Mapping[str, Any], workers: list[dict[str, Any]], *, done: bool) -> int:
    """The job's steps: the count rank 0 reported with the result -- or, where workers keep their
    own step counts (adpsgd, partial_reduce) and a lagging rank 0 ended when the others had
    finished theirs, the furthest any worker trained (its last step + 1)."""
    furthest = max((int(w["step"]) for w in workers if w.get("step") is not None), default=0)
    if "steps" not in final:
        return furthest
    return max(int(final["steps"]), furthest + 1) if done else int(final["steps"])


def run_summary(snap: Mapping[str, Any], *, strategy: str, wall_s: float | None = None) -> dict[str, Any]:
    """The summary of a data-parallel run from the coordinator's final ``snapshot()``.

    ``wall_s``: the job's wall time when it was done (default: the snapshot's elapsed time).
    """
    final = normalize_eval(snap["final"])
    evals = [normalize_eval(e) for e in snap["evals"]]
    workers = snap["workers"]
    samples = sum(w["samples"] for w in workers)
    wall = wall_s if wall_s is not None else snap["elapsed_s"]
    named = final if HEADLINE in final else (evals[-1] if evals else {})
    summary = {
        HEADLINE: named.get(HEADLINE),
        HEADLINE_MODE: named.get(HEADLINE_MODE),
        "test_loss": final.get("test_loss"),
        "steps": _steps(final, workers, done=bool(snap["done"])),
        "wall_s": wall,
        "samples_per_s": samples / wall if wall > 0 else 0.0,
        # (the final view's members; in a finished job, at least those that finished: under
        # adpsgd a worker that finished its steps leaves the view before the end)
        "num_workers": max(
            len(set(snap["members"]) - {w.get("worker_id") for w in workers if w["state"] == "dead"}),
            sum(w["state"] == "done" for w in workers) if snap["done"] else 0,
        ),
        "num_workers_started": len(workers),
        "membership_epochs": snap["epoch"],
        "completed": bool(snap["done"]),
        "final_digest": final.get("digest"),
        "workers": [worker_row(w) for w in workers],
        "evals": evals,
        "strategy": strategy,
    }
    if snap.get("t0_unix") is not None:  # the coordinator's start; records' time_s count from it
        summary["t0_unix"] = snap["t0_unix"]
    # workers the job went on without (roles/members_lost.py): who, when, why
    summary["members_lost"] = [dict(m) for m in snap.get("members_lost", ())]
    summary["degraded"] = degraded_note(summary["members_lost"], len(workers))
    summary["members_left"] = [dict(m) for m in snap.get("members_left", ())]  # left before the end
    if snap.get("max_clock_spread") is not None:
        summary["max_clock_spread"] = snap["max_clock_spread"]
    rejections = snap.get("rejections")  # inputs the coordinator refused (comm/rejections.py)
    if rejections:
        summary["rejections"] = {str(r): sum(by.values()) for r, by in rejections.items()}
    stats = snap.get(strategy)  # the strategy's service's counts (sync.spec.Service.stats)
    if stats:
        summary["strategy_stats"] = stats
    pr = snap.get("partial_reduce")  # strategy partial_reduce: the controller's counts
    if pr:
        summary.update({f"pr_{k}": v for k, v in pr.items()})
    summary.update({k: v for k, v in final.items() if k.startswith("test_") and k not in summary})
    if final.get("model_file"):
        summary["model_file"] = final["model_file"]
    return summary


def degraded_note(members_lost: Sequence[Mapping[str, Any]], num_started: int) -> str | None:
    """Why a run that went on without some of its members is not a plain success (``completed``
    says whether it finished; this says what it lost), or None when it lost nobody."""
    if not members_lost:
        return None
    names = ", ".join(
        str(m["name"]) + (" came back" if m.get("rejoined_as") is not None else "") for m in members_lost
    )
    return f"lost {len(members_lost)} of {num_started} workers ({names}): see members_lost"


def final_summary(snap: Mapping[str, Any], *, strategy: str, wall_s: float | None = None) -> dict[str, Any]:
    """:func:`run_summary` with the run's ``error``: the one the job stopped with, or, for a run
    that ended without finishing and without one, :func:`unfinished_reason`."""
    summary = run_summary(snap, strategy=strategy, wall_s=wall_s)
    if snap.get("error"):
        summary["error"] = snap["error"]
    elif not summary["completed"]:
        summary["error"] = unfinished_reason(summary)
    return summary


def unfinished_reason(summary: Mapping[str, Any]) -> str:
    """Why a data-parallel run ended without finishing, when nothing else said (the ``error`` of a
    summary with ``completed: false``): who was lost or left, and why."""
    gone = [*summary.get("members_lost", ()), *summary.get("members_left", ())]
    why = "; ".join(f"{m['name']}: {m['why']}" for m in gone[:8]) + ("; ..." if len(gone) > 8 else "")
    return (
        f"the job did not complete: it ended at step {summary.get('steps', 0)} with no worker left "
        f"to train ({len(gone)} of {summary.get('num_workers_started', 0)} workers lost or gone"
        + (f": {why})" if gone else ")")
    )


def _train_losses(last_stage: Mapping[str, Any]) -> list[float]:
    """The last stage's per-step training losses in step order."""
    items = sorted(last_stage["step_losses"].items(), key=lambda kv: int(kv[0]))
    return [float(v) for _, v in items]


def pipeline_summary(
    *,
    job: Mapping[str, Any],
    stages: Sequence[Mapping[str, Any]],
    processes: Sequence[int] | None = None,
    schedule: Schedule,
    plan: PipelinePlan,
    evaluation: Mapping[str, float | None],
    job_wall_s: float,
    gantt: Path,
    gantt_modelled: Path | None,
    headline: Headline | None = None,
    plans: Mapping[int, PipelinePlan] | None = None,
) -> dict[str, Any]:
    """The summary of a pipeline run.

    ``job``: the launcher's job file (``layer_ends``, ``stage_names``, ``speeds``, ``config``,
    ``replicas``); ``stages``: the result files (``stage<G>.json``) of the stage processes
    ``processes`` (default: all of them, in order): the surviving instances', the lead instance's
    first; ``replicas_identical`` says whether every instance's stage i ended with the same
    weights' digest as the lead's; ``evaluation``: the task's
    evaluation of the assembled final model on the test split (``loss`` and every metric; a
    ``None`` value is left out); ``headline``: the task's (``headline_of``; default: the rule of
    ``flotilla.report.headline`` without a task); ``plans``: each instance's own plan where the
    instances were placed with their own cuts (``instance_ends``; default: ``plan`` for all).
    """
    replicas = int(job.get("replicas", 1))
    ends = [list(e) for e in job.get("instance_ends") or [job["layer_ends"]] * replicas]
    places = tuple((int(r), int(i)) for r, i in job.get("process_places") or ())  # (instances formed again)
    layout = Layout(tuple(len(e) for e in ends), places)
    processes = list(processes) if processes is not None else list(range(len(stages)))
    where = [layout.place(g) for g in processes]  # (stages[i] is process processes[i])
    lead = where[0].replica
    batch_size = int(job["config"]["job"]["batch_size"])
    losses = _train_losses(stages[layout.counts[lead] - 1])
    lead_digests = {w.stage: s.get("digest") for w, s in zip(where, stages, strict=True) if w.replica == lead}

    def plan_of(instance: int) -> PipelinePlan:
        return plans[instance] if plans is not None and instance in plans else plan

    wall_s = max(float(s["wall_s"]) for s in stages)
    steps = schedule.num_minibatches
    rate = steps * batch_size / wall_s
    tail = losses[-max(1, min(10, len(losses) // 5)) :]
    values = {k: v for k, v in evaluation.items() if v is not None}
    head = headline or headline_of(None, values)
    tests = {f"test_{k}": v for k, v in values.items()} | head.fields()
    return {
        **tests,
        "test_loss": evaluation["loss"],
        "steps": steps,
        "wall_s": wall_s,
        "job_wall_s": job_wall_s,
        "samples_per_s": rate,
        "num_workers": len(stages),
        "num_workers_started": len(job["stage_names"]),
        "replicas": replicas,
        # (instances cut differently hold different layers per stage: nothing to compare)
        "replicas_identical": all(
            s.get("digest") == lead_digests.get(w.stage) for w, s in zip(where, stages, strict=True)
        )
        if len({tuple(e) for e in ends}) == 1
        else None,
        # (a stage group the network broke re-forms in the next epoch: roles/stage_parts.py)
        "membership_epochs": max((int(s.get("membership_epoch", 1)) for s in stages), default=1),
        "completed": True,
        "strategy": str(job["config"].get("strategy", {}).get("kind", "pipeline")),
        "schedule": schedule.kind.value,
        "num_microbatches": schedule.num_microbatches,
        "vertical_sync": schedule.vertical_sync,
        "layer_ends": ends[lead],  # (the lead instance's split: its plan is ``plan``)
        "first_train_loss": losses[0] if losses else None,
        "final_train_loss": sum(tail) / len(tail) if tail else None,
        "train_losses": losses,
        "measured_step_s": wall_s / steps,
        "predicted_step_s": plan.predicted_step_s,
        "plan": plan.to_dict(),
        "gantt": str(gantt),
        "gantt_modelled": str(gantt_modelled) if gantt_modelled else None,
        "workers": [
            {"name": job["stage_names"][g], "speed": job["speeds"][g], "state": "done", "step": steps}
            | {"samples_per_s": rate}
            for g in processes
        ],
        "stages": [
            {k: s[k] for k in _STAGE_KEYS}
            | {
                "name": job["stage_names"][w.index],
                "replica": w.replica,
                "device": s.get("device", "cpu"),
                "transport": s.get("transport", "gloo"),
                "memory": _memory_row(s.get("memory"), plan_of(w.replica), w.stage),
            }
            for w, s in zip(where, stages, strict=True)
        ],
        "evals": [{"step": steps, **tests}],
    }
