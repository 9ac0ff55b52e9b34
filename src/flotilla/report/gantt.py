"""Gantt charts of pipeline timelines (matplotlib, Agg backend, PNG).

Input: a timeline, i.e. a sequence of ``(stage_idx, action, start_s, end_s)`` -- either modelled
(``flotilla.pipeline.timeline.modelled_timeline``) or measured by the stage runtime.  ``action`` is
a schedule ``Action``, its text form (``"F3@v0"``, see ``schedule.format_action``) or a free-form
label containing one of forward/backward/optimizer/update/send/recv (e.g. ``"forward 3"``).

Drawing: one row per stage (stage 0 on top).  Compute boxes fill the upper part of the row and are
coloured by kind (forward, backward, update); the microbatch number is written inside when the box
is wide enough.  Communication (send transfers, receive waits) is drawn as thin bars in the lower
part of the row, so asynchronous transfers that overlap compute stay visible.  Rendering never
touches the global pyplot state (a ``Figure`` is built directly), so it is safe in threads.

A pipeline run draws two charts: ``measured_gantt`` (the stages' recorded timelines over the
``gantt_window`` of minibatches, which the stage role uses to decide what to keep) and
``modelled_gantt`` (the same kind of schedule replayed with the plan's modelled times).  matplotlib
is imported only when a chart is drawn, so a stage process that only selects its window loads none.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from io import BytesIO
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flotilla.core.atomic_io import atomic_write_bytes
from flotilla.core.errors import ConfigError
from flotilla.pipeline.schedule import (
    Action,
    Backward,
    Forward,
    OptimizerStep,
    RecvAct,
    RecvGrad,
    Schedule,
    SendAct,
    SendGrad,
    parse_action,
)
from flotilla.pipeline.timeline import modelled_timeline

if TYPE_CHECKING:
    from flotilla.pipeline.plan import PipelinePlan
    from flotilla.pipeline.profile import ModelProfile

__all__ = [
    "classify",
    "entry_step",
    "gantt_window",
    "measured_gantt",
    "modelled_gantt",
    "render_gantt",
]

COLOURS = {
    "forward": "#4C72B0",
    "backward": "#55A868",
    "update": "#C44E52",
    "send": "#8172B2",
    "recv": "#CCB974",
    "other": "#999999",
}
_COMPUTE = ("forward", "backward", "update", "other")
_WORDS = (
    ("forward", "forward"),
    ("backward", "backward"),
    ("optimizer", "update"),
    ("update", "update"),
    ("send", "send"),
    ("recv", "recv"),
)


def classify(action: Any) -> tuple[str, int | None]:
    """(kind, microbatch number or None) of an action object or label."""
    if isinstance(action, Forward):
        return "forward", action.microbatch_idx
    if isinstance(action, Backward):
        return "backward", action.microbatch_idx
    if isinstance(action, OptimizerStep):
        return "update", None
    if isinstance(action, (SendAct, SendGrad)):
        return "send", action.microbatch_idx
    if isinstance(action, (RecvAct, RecvGrad)):
        return "recv", action.microbatch_idx
    text = str(action)
    try:
        return classify(parse_action(text))
    except ConfigError:
        pass
    lowered = text.lower()
    number = re.search(r"\d+", text)
    for word, kind in _WORDS:
        if word in lowered:
            return kind, int(number.group()) if number and kind != "update" else None
    return "other", None


def render_gantt(
    timeline: Sequence[Sequence[Any]],
    path: str | os.PathLike[str],
    title: str | None = None,
    num_stages: int | None = None,
    show_comm: bool = True,
) -> Path:
    """Draw ``timeline`` to a PNG at ``path`` (written atomically) and return the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    entries = [(int(e[0]), e[1], float(e[2]), float(e[3])) for e in timeline]
    if not entries:
        raise ConfigError("render_gantt: the timeline is empty")
    if any(end < start for _, _, start, end in entries):
        raise ConfigError("render_gantt: every entry needs end_s >= start_s")
    rows = num_stages if num_stages is not None else max(e[0] for e in entries) + 1
    t0 = min(e[2] for e in entries)
    span = max(e[3] for e in entries) - t0 or 1.0
    fig = Figure(figsize=(min(4 + 0.25 * len(entries) / rows, 24), 0.9 + 0.7 * rows), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for stage, action, start, end in entries:
        kind, number = classify(action)
        if end > start and (kind in _COMPUTE or show_comm):
            bars.setdefault((stage, kind), []).append((start - t0, end - start))
        if kind in _COMPUTE and number is not None and (end - start) / span > 0.012:
            ax.text(
                (start + end) / 2 - t0,
                stage + 0.36,
                str(number),
                ha="center",
                va="center",
                color="white",
                fontsize=7 if (end - start) / span > 0.02 else 5,
            )
    for (stage, kind), spans in bars.items():
        _draw(ax, stage, kind, spans)
    ax.set_ylim(rows - 0.05, -0.05)
    ax.set_xlim(0, span)
    ax.set_yticks([r + 0.5 for r in range(rows)], [f"stage {r}" for r in range(rows)])
    ax.set_xlabel("time (s)")
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title)
    shown = ["forward", "backward", "update"] + (["send", "recv"] if show_comm else [])
    ax.legend(
        handles=[Patch(color=COLOURS[k], label=k) for k in shown],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 if rows < 3 else -0.2),
        ncol=len(shown),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    target = Path(path)
    buffer = BytesIO()
    fig.savefig(buffer, format="png")
    atomic_write_bytes(target, buffer.getvalue())
    return target


def _draw(ax: Any, stage: int, kind: str, spans: list[tuple[float, float]]) -> None:
    """One collection per (stage, kind): compute in the upper lane, sends and receives below."""
    if kind in _COMPUTE:
        ax.broken_barh(
            spans, (stage + 0.05, 0.62), facecolors=COLOURS[kind], edgecolor="white", linewidth=0.6
        )
    else:
        lane = 0.72 if kind == "send" else 0.84
        ax.broken_barh(spans, (stage + lane, 0.1), facecolors=COLOURS[kind], linewidth=0)


def gantt_window(schedule: Schedule) -> tuple[int, int]:
    """Minibatches drawn in the measured Gantt chart: a few after the first (warm-up) ones."""
    n = schedule.num_minibatches
    width = 2 if schedule.kind.flushes else 3 * schedule.num_stages + 2
    lo = min(1, max(0, n - width))
    return lo, min(n, lo + width)


def entry_step(schedule: Schedule, action: Action) -> int:
    """The minibatch (step) an action belongs to; an optimizer step belongs to the version it reads."""
    if isinstance(action, OptimizerStep):
        return action.reads_version
    return schedule.minibatch_of(action.microbatch_idx)


def measured_gantt(stages: Sequence[dict[str, Any]], schedule: Schedule, path: Path) -> Path:
    """The chart of the stages' recorded timelines (``stage<I>.json``: ``timeline``, ``gantt_window``)."""
    entries = [(e[0], parse_action(e[1]), e[2], e[3]) for s in stages for e in s["timeline"]]
    lo, hi = stages[0]["gantt_window"]
    title = (
        f"measured: {schedule.kind.value}, {schedule.num_stages} stages, "
        f"{schedule.num_microbatches} microbatch(es)/step, steps {lo}..{hi - 1}"
    )
    return render_gantt(entries, path, title=title, num_stages=schedule.num_stages)


def modelled_gantt(
    plan: PipelinePlan,
    profile: ModelProfile,
    schedule: Schedule,
    speeds: Sequence[float],
    path: Path,
) -> Path:
    """``schedule`` (a short one of the run's kind) replayed with the plan's per-microbatch times:
    each stage's profiled layer times divided by its device's speed and the microbatch count."""
    m, p = schedule.num_microbatches, schedule.num_stages
    fwd, bwd = [], []
    for st, speed in zip(plan.stages, speeds):
        layers = profile.layers[st.layer_start : st.layer_end]
        fwd.append(sum(x.forward_s for x in layers) / speed / m)
        bwd.append(sum(x.backward_s for x in layers) / speed / m)
    comm = [st.comm_s / 2 / m for st in plan.stages[:-1]]
    timeline = modelled_timeline(schedule, fwd, bwd, comm)
    return render_gantt(
        timeline, path, title=f"modelled: {schedule.kind.value}, {p} stages (plan times)", num_stages=p
    )
