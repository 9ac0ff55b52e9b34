"""Plots of simulated runs (``flotilla simulate --plots DIR``, ``docs/simulator.md``).

Input: per strategy its timeline, ``(time_s, steps done, live workers)`` points in simulated
seconds (``SimResult.timeline``; plain data, so this module does not depend on the simulator).

- ``sim_throughput.png``: steps per second over simulated time, one line per strategy (in 200
  equal spans of time).  The steps are the timeline's: the job's under all-reduce and DiLoCo, the
  most advanced worker's under partial reduce, rank 0's under AD-PSGD -- a decentralised line falls
  to 0 when those finish while slower workers train on;
- ``sim_membership.png``: live workers over simulated time, one step line per strategy through
  every point where the count changes (the revocations and arrivals of a spot trace).

Drawn on matplotlib's Agg canvas (``Figure``, never ``pyplot``) and written atomically, as the run
report's plots are (``report/plots.py``).
"""

from __future__ import annotations

import bisect
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flotilla.core.atomic_io import atomic_write_bytes

__all__ = ["SIM_MEMBERSHIP_PLOT", "SIM_THROUGHPUT_PLOT", "sim_plots"]

SIM_THROUGHPUT_PLOT = "sim_throughput.png"
SIM_MEMBERSHIP_PLOT = "sim_membership.png"
Timeline = Sequence[tuple[float, int, int]]


def _rates(points: Timeline, bins: int = 200) -> tuple[list[float], list[float]]:
    """Steps per second in ``bins`` equal spans of simulated time (at their midpoints): the steps
    done at a span's end minus at its start, over its length (a span without a point counts what
    the last point before it says: no spikes where points crowd, e.g. at membership changes)."""
    ts = [p[0] for p in points]
    t0, t1 = ts[0], ts[-1]
    if t1 <= t0:
        return [], []
    n = max(1, min(bins, len(points) - 1))
    width = (t1 - t0) / n

    def steps_at(t: float) -> int:
        i = bisect.bisect_right(ts, t) - 1
        return points[max(i, 0)][1]

    edges = [t0 + k * width for k in range(n)] + [t1]
    xs = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
    ys = [(steps_at(b) - steps_at(a)) / (b - a) for a, b in zip(edges, edges[1:])]
    return xs, ys


def _axes(title: str, ylabel: str) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.5))
    ax = fig.add_subplot(1, 1, 1)
    ax.set_title(title)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    atomic_write_bytes(path, buf.getvalue())
    return path


def sim_plots(out_dir: str | Path, timelines: Mapping[str, Timeline], *, title: str = "") -> list[Path]:
    """Write the two plots of the module doc for ``timelines`` (strategy -> timeline) into
    ``out_dir`` (created); returns their paths.  A strategy with an empty timeline is left out."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    drawn = {k: v for k, v in timelines.items() if v}
    label = "steps / s (see docs/simulator.md)"
    fig, ax = _axes(f"Simulated throughput{': ' + title if title else ''}", label)
    for name, points in drawn.items():
        xs, ys = _rates(points)
        ax.plot(xs, ys, label=name, linewidth=1.2)
    if drawn:
        ax.legend(loc="best", fontsize="small")
    paths = [_save(fig, out / SIM_THROUGHPUT_PLOT)]
    fig, ax = _axes(f"Live workers{': ' + title if title else ''}", "live workers")
    for name, points in drawn.items():
        changes = [p for i, p in enumerate(points) if i == 0 or p[2] != points[i - 1][2]] + [points[-1]]
        ax.step([p[0] for p in changes], [p[2] for p in changes], where="post", label=name, linewidth=1.2)
    if drawn:
        ax.legend(loc="best", fontsize="small")
    paths.append(_save(fig, out / SIM_MEMBERSHIP_PLOT))
    return paths
