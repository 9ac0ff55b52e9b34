"""Run plots from ``metrics.jsonl``: ``loss_vs_time.png`` and ``throughput_vs_time.png``; from
``evals.jsonl``, when the run evaluated periodically: ``eval_vs_time.png``, the task's headline
metric (``report/headline.py``: e.g. test RMSE, lower is better) and the test loss over time.

Invariants: plots are drawn with matplotlib's Agg canvas (``Figure`` objects, never ``pyplot``, so
no display and no global figure state) and written atomically; workers may join or leave at any
time: each worker's line covers only the time it reported, the mean loss of a step averages the
workers that reported that step, and membership-epoch changes are marked.
"""

from __future__ import annotations

import io
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flotilla.core.atomic_io import atomic_write_bytes
from flotilla.report.headline import Headline, headline_from_record, normalize_eval
from flotilla.report.metrics import (
    EVAL_PLOT,
    EVALS_FILE,
    LOSS_PLOT,
    REQUIRED_METRIC_KEYS,
    THROUGHPUT_PLOT,
    read_jsonl,
    read_metrics,
    require_keys,
)

__all__ = ["eval_plot", "make_plots"]


def _series(records: list[dict[str, Any]]) -> dict[Any, dict[str, np.ndarray]]:
    """Per worker: time (from the run's start), loss and samples, sorted by time."""
    t0 = min(float(r["time_s"]) for r in records)
    per: dict[Any, list[tuple[float, float, float]]] = defaultdict(list)
    for r in records:
        loss = math.nan if r["loss"] is None else float(r["loss"])
        per[r["worker_id"]].append((float(r["time_s"]) - t0, loss, float(r["samples"])))
    out = {}
    for wid, rows in per.items():
        arr = np.array(sorted(rows), dtype=np.float64).reshape(-1, 3)
        out[wid] = {"t": arr[:, 0], "loss": arr[:, 1], "samples": arr[:, 2]}
    return out


def _segments(t: np.ndarray) -> list[slice]:
    """Split a worker's sorted times where it was absent (gap > 5x its median interval)."""
    if len(t) < 3:
        return [slice(0, len(t))]
    dt = np.diff(t)
    cuts = (np.nonzero(dt > 5.0 * max(float(np.median(dt)), 1e-9))[0] + 1).tolist()
    bounds = [0, *cuts, len(t)]
    return [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _joined(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate line segments with NaN separators so matplotlib breaks the line between them."""
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    for x, y in parts:
        xs += [x, np.array([np.nan])]
        ys += [y, np.array([np.nan])]
    return (np.concatenate(xs), np.concatenate(ys)) if xs else (np.empty(0), np.empty(0))


def _smoothed_rate(t: np.ndarray, samples: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """samples/s over the last ``window`` records: ``sum(samples[j+1..i]) / (t[i] - t[j])``."""
    if len(t) < 2:
        return t[:0], t[:0]
    cum = np.cumsum(samples)
    i = np.arange(1, len(t))
    j = np.maximum(i - window, 0)
    dt = t[i] - t[j]
    rate = np.where(dt > 0, (cum[i] - cum[j]) / np.where(dt > 0, dt, 1.0), np.nan)
    return t[i], rate


def _mean_loss(series: dict[Any, dict[str, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Mean loss over workers in time bins: each bin averages the per-worker means of the workers
    that reported in it, so it works for synchronous and asynchronous steps alike."""
    t_all = np.concatenate([s["t"] for s in series.values()])
    span = float(t_all.max()) if len(t_all) else 0.0
    per_worker = max(len(s["t"]) for s in series.values())
    edges = np.linspace(0.0, span if span > 0 else 1.0, int(min(100, max(2, per_worker // 2))) + 1)
    total, count = np.zeros(len(edges) - 1), np.zeros(len(edges) - 1)
    for s in series.values():
        ok = np.isfinite(s["loss"])
        idx = np.clip(np.searchsorted(edges, s["t"][ok], side="right") - 1, 0, len(edges) - 2)
        sums, hits = np.bincount(idx, s["loss"][ok], len(total)), np.bincount(idx, None, len(total))
        has = hits > 0
        total[has] += sums[has] / hits[has]
        count[has] += 1
    centres = 0.5 * (edges[1:] + edges[:-1])
    keep = count > 0
    return centres[keep], total[keep] / count[keep]


def _membership_changes(records: list[dict[str, Any]], t0: float) -> list[tuple[float, Any]]:
    """First time each membership epoch (after the first) appears."""
    first: dict[Any, float] = {}
    for r in records:
        me, ts = r["membership_epoch"], float(r["time_s"]) - t0
        first[me] = min(ts, first.get(me, math.inf))
    return sorted(((ts, me) for me, ts in first.items()), key=lambda p: p[0])[1:]


def strategy_switches(records: list[dict[str, Any]], t0: float = 0.0) -> list[tuple[float, str]]:
    """When the job switched strategies (records name the running one: ``strategy``): for each
    switch, the first time a worker recorded a unit under the new strategy, and ``"a -> b"``."""
    last: dict[Any, str] = {}
    count: dict[Any, int] = {}
    first: dict[tuple[int, str], float] = {}
    for r in sorted(records, key=lambda r: float(r["time_s"])):
        now, who = r.get("strategy"), r.get("worker_id", r.get("name"))
        if not isinstance(now, str) or not now:
            continue
        before = last.get(who)
        last[who] = now
        if before is not None and before != now:
            count[who] = count.get(who, 0) + 1
            key = (count[who], f"{before} -> {now}")
            first[key] = min(first.get(key, math.inf), float(r["time_s"]) - t0)
    return sorted((t, label) for (_, label), t in first.items())


def mark_switches(ax: Any, switches: Sequence[tuple[float, str]], *, text: bool = True) -> None:
    for i, (ts, label) in enumerate(switches):
        ax.axvline(
            ts, color="tab:red", linestyle="--", linewidth=0.9, label="strategy switch" if i == 0 else None
        )
        if text:
            ax.text(
                ts,
                1.0,
                f" {label}",
                transform=ax.get_xaxis_transform(),
                fontsize=7,
                color="tab:red",
                va="top",
            )


def _mark_changes(
    ax: Any, changes: list[tuple[float, Any]], switches: Sequence[tuple[float, str]] = ()
) -> None:
    for i, (ts, _) in enumerate(changes):
        ax.axvline(
            ts, color="grey", linestyle=":", linewidth=0.8, label="membership change" if i == 0 else None
        )
    mark_switches(ax, switches)


def _save(fig: Any, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    atomic_write_bytes(path, buf.getvalue())
    return path


def _new_axes(title: str, ylabel: str) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _plot_loss(series: dict, changes: list, path: Path, switches: Sequence[tuple[float, str]] = ()) -> Path:
    fig, ax = _new_axes("Training loss", "loss")
    for wid in sorted(series, key=str):
        t, loss = series[wid]["t"], series[wid]["loss"]
        parts = [(t[seg], loss[seg]) for seg in _segments(t)]
        ax.plot(*_joined(parts), linewidth=0.8, alpha=0.6, label=f"worker {wid}")
    mt, ml = _mean_loss(series)
    ax.plot(mt, ml, color="black", linewidth=1.8, label="mean over workers")
    if len(ml) and np.nanmin(ml) > 0 and np.nanmax(ml) / np.nanmin(ml) > 20:
        ax.set_yscale("log")
    _mark_changes(ax, changes, switches)
    ax.legend(fontsize="small", ncol=2)
    return _save(fig, path)


def _plot_throughput(
    series: dict, changes: list, window: int, path: Path, switches: Sequence[tuple[float, str]] = ()
) -> Path:
    fig, ax = _new_axes(f"Throughput (smoothed over {window} steps)", "samples / s")
    all_t = np.concatenate([s["t"] for s in series.values()])
    all_n = np.concatenate([s["samples"] for s in series.values()])
    for wid in sorted(series, key=str):
        t, n = series[wid]["t"], series[wid]["samples"]
        parts = [_smoothed_rate(t[seg], n[seg], window) for seg in _segments(t)]
        ax.plot(*_joined(parts), linewidth=0.9, label=f"worker {wid}")
    span = float(all_t.max() - all_t.min()) if len(all_t) else 0.0
    if span > 0:
        num_bins = int(min(50, max(5, len(all_t) // max(1, len(series)) // window)))
        hist, edges = np.histogram(all_t, bins=num_bins, weights=all_n)
        ax.stairs(
            hist / np.diff(edges), edges, baseline=None, color="black", linewidth=1.5, label="job total"
        )
    _mark_changes(ax, changes, switches)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small", ncol=2)
    return _save(fig, path)


def _eval_points(evals: list[dict[str, Any]], field: str, t0: float) -> tuple[np.ndarray, np.ndarray]:
    rows = sorted(
        (float(e["time_s"]) - t0, float(e[field]))
        for e in evals
        if e.get(field) is not None and e.get("time_s") is not None
    )
    arr = np.array(rows, dtype=np.float64).reshape(-1, 2)
    return arr[:, 0], arr[:, 1]


def _plot_evals(
    evals: list[dict[str, Any]],
    head: Headline,
    t0: float,
    path: Path,
    switches: Sequence[tuple[float, str]] = (),
) -> Path | None:
    """The headline metric (left axis) and the test loss (right axis, unless it is the headline)
    of each evaluation over time; None when no evaluation has the headline's value."""
    t, v = _eval_points(evals, head.field, t0)
    if not len(t):
        return None
    fig, ax = _new_axes(f"Test {head.label}", f"test {head.metric}")
    ax.plot(t, v, marker="o", color="tab:blue", label=f"test {head.metric}")
    best = int(np.argmax(v) if head.mode == "max" else np.argmin(v))
    ax.annotate(
        f"best {v[best]:.4g}", (t[best], v[best]), textcoords="offset points", xytext=(-4, 8), ha="right"
    )
    mark_switches(ax, switches)
    handles, labels = ax.get_legend_handles_labels()
    if head.field != "test_loss":
        lt, lv = _eval_points(evals, "test_loss", t0)
        if len(lt):
            ax2 = ax.twinx()
            ax2.plot(lt, lv, marker=".", linestyle="--", color="tab:red", label="test loss")
            ax2.set_ylabel("test loss")
            more = ax2.get_legend_handles_labels()
            handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, fontsize="small")
    return _save(fig, path)


def eval_plot(
    report_dir: str | Path,
    headline: Headline | None = None,
    *,
    t0: float = 0.0,
    switches: Sequence[tuple[float, str]] = (),
) -> Path | None:
    """Draw ``eval_vs_time.png`` from ``evals.jsonl`` (None: no evaluation to draw).  ``headline``:
    the metric to draw (default: the one the records name); ``t0``: the time axis' origin, in the
    records' ``time_s``; ``switches``: strategy switches to mark (:func:`strategy_switches`)."""
    report = Path(report_dir)
    evals = [normalize_eval(e) for e in read_jsonl(report / EVALS_FILE, missing_ok=True)]
    head = headline or next((h for h in map(headline_from_record, reversed(evals)) if h), None)
    return None if head is None else _plot_evals(evals, head, t0, report / EVAL_PLOT, switches)


def make_plots(report_dir: str | Path, *, window: int = 10, headline: Headline | None = None) -> list[Path]:
    """Draw ``loss_vs_time.png`` and ``throughput_vs_time.png`` from ``metrics.jsonl``, and
    ``eval_vs_time.png`` from ``evals.jsonl`` when there is one (``headline``: the metric it
    draws; default: the one its records name).

    Returns the written paths; ``[]`` when ``metrics.jsonl`` holds no records.  ``window`` is the
    number of steps each worker's throughput is smoothed over.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    report = Path(report_dir)
    records = read_metrics(report)
    for r in records:
        require_keys(r, REQUIRED_METRIC_KEYS, "metrics record")
    if not records:
        return []
    series = _series(records)
    t0 = min(float(r["time_s"]) for r in records)
    changes = _membership_changes(records, t0)
    switches = strategy_switches(records, t0)
    paths = [
        _plot_loss(series, changes, report / LOSS_PLOT, switches),
        _plot_throughput(series, changes, window, report / THROUGHPUT_PLOT, switches),
    ]
    evals = eval_plot(report, headline, t0=t0, switches=switches)
    return paths + ([evals] if evals is not None else [])
