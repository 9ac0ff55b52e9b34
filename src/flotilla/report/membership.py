"""The membership timeline of a run with revocations: ``membership.png`` and the recovery figures.

Inputs (both in the report directory, both with ``time_s`` in seconds since the coordinator's t0):
``metrics.jsonl`` (each worker's step records: ``name``, ``committed``, ``membership_epoch``,
``world_size``) and ``revocations.jsonl`` (what the launcher's revocation driver did: ``action``
kill / stop / add, ``worker``; ``launch/revocations.py``).

Recovery of a revocation (kill or stop) of a worker that was in the view = from the revocation to
the first committed step, by any worker, in a membership epoch newer than every epoch seen
committed before the revocation (the survivors have left the victim behind and trained on).
``None`` when no such step came (the job ended first), or when the victim had committed no step
in that epoch (it was still starting up: nothing to recover from, counted as ``outside_a_view``).
The picture: one lane per worker (a dot per committed step, so a gap is a worker
out of the view), the number of workers in the view above it, revocations as vertical marks, and
each recovery as a bracket from the revocation to that first step.
"""

from __future__ import annotations

import io
import statistics
from pathlib import Path
from typing import Any

from flotilla.core.atomic_io import atomic_write_bytes
from flotilla.report.metrics import METRICS_FILE, read_jsonl
from flotilla.report.plots import mark_switches, strategy_switches

__all__ = ["MEMBERSHIP_PLOT", "REVOCATIONS_FILE", "membership_plot", "recoveries", "recovery_summary"]

MEMBERSHIP_PLOT = "membership.png"
REVOCATIONS_FILE = "revocations.jsonl"
_COLOURS = {"kill": "tab:red", "stop": "tab:orange", "add": "tab:green"}


def _metrics(report: Path) -> list[dict[str, Any]]:
    return read_jsonl(report / METRICS_FILE, missing_ok=True)


def _committed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    steps = [r for r in records if r.get("committed") and r.get("kind") != "eval" and "membership_epoch" in r]
    return sorted(steps, key=lambda r: float(r["time_s"]))


def recoveries(records: list[dict[str, Any]], revocations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each kill or stop with its ``recovery_s`` (None: no step after it in a newer epoch)."""
    steps = _committed(records)
    out = []
    for rev in revocations:
        if rev.get("action") not in ("kill", "stop"):
            continue
        at = float(rev["time_s"])
        before = [r for r in steps if float(r["time_s"]) <= at]
        epoch = max((int(r["membership_epoch"]) for r in before), default=0)
        member = any(r["name"] == rev["worker"] and int(r["membership_epoch"]) == epoch for r in before)
        after = next(
            (r for r in steps if float(r["time_s"]) > at and int(r["membership_epoch"]) > epoch), None
        )
        recovery = None if after is None or not member else round(float(after["time_s"]) - at, 3)
        out.append({**rev, "member": member, "recovery_s": recovery})
    return out


def recovery_summary(report_dir: str | Path) -> dict[str, Any] | None:
    """Counts and the p50 / max recovery of a run's revocations (None: the run had none)."""
    report = Path(report_dir)
    revs = read_jsonl(report / REVOCATIONS_FILE, missing_ok=True)
    if not revs:
        return None
    done = recoveries(_metrics(report), revs)
    members = [r for r in done if r["member"]]
    times = [r["recovery_s"] for r in members if r["recovery_s"] is not None]
    counts = {a: sum(1 for r in revs if r.get("action") == a) for a in ("kill", "stop", "add")}
    return {
        **counts,
        "outside_a_view": len(done) - len(members),  # the victim was starting up: nothing to recover
        "recovered": len(times),
        "not_recovered": len(members) - len(times),
        "recovery_p50_s": round(statistics.median(times), 3) if times else None,
        "recovery_max_s": round(max(times), 3) if times else None,
    }


def membership_plot(report_dir: str | Path) -> Path | None:
    """Draw ``membership.png`` (None: the run had no revocations or no committed step)."""
    report = Path(report_dir)
    revs = read_jsonl(report / REVOCATIONS_FILE, missing_ok=True)
    records = _metrics(report) if revs else []
    steps = _committed(records)
    if not steps:
        return None
    from matplotlib.figure import Figure

    names = sorted({str(r["name"]) for r in steps} | {str(r["worker"]) for r in revs})
    lane = {n: i for i, n in enumerate(names)}
    fig = Figure(figsize=(10, 2.5 + 0.35 * len(names)), layout="constrained")
    top, ax = fig.subplots(2, 1, sharex=True, height_ratios=[1, 2])
    top.step([float(r["time_s"]) for r in steps], [int(r["world_size"]) for r in steps], where="post")
    top.set_ylabel("workers in view")
    top.set_title("Membership: revocations and recoveries")
    top.grid(True, alpha=0.3)
    for n in names:
        t = [float(r["time_s"]) for r in steps if r["name"] == n]
        ax.plot(t, [lane[n]] * len(t), "|", color="tab:blue", markersize=6)
    seen: set[str] = set()
    for rev in recoveries(records, revs) + [r for r in revs if r.get("action") == "add"]:
        action, at = str(rev["action"]), float(rev["time_s"])
        label = action if action not in seen else None
        seen.add(action)
        for axis in (top, ax):
            axis.axvline(at, color=_COLOURS.get(action, "grey"), linestyle=":", linewidth=0.9)
        ax.plot([at], [lane[str(rev["worker"])]], "o", color=_COLOURS.get(action, "grey"), label=label)
        if rev.get("recovery_s") is not None:
            y = lane[str(rev["worker"])] + 0.25
            ax.annotate("", xy=(at + rev["recovery_s"], y), xytext=(at, y), arrowprops={"arrowstyle": "|-|"})
            ax.text(at, y + 0.08, f"{rev['recovery_s']:.2f} s", fontsize=7)
    switches = strategy_switches(steps)
    mark_switches(top, switches)
    mark_switches(ax, switches, text=False)
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(-0.5, len(names) - 0.2)  # (room for the top lane's recovery bracket)
    ax.set_xlabel("time since start (s)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    path = report / MEMBERSHIP_PLOT
    atomic_write_bytes(path, buf.getvalue())
    return path
