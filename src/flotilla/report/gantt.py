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
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from io import BytesIO
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from flotilla.core.atomic_io import atomic_write_bytes
from flotilla.core.errors import ConfigError
from flotilla.pipeline.schedule import (
    Backward,
    Forward,
    OptimizerStep,
    RecvAct,
    RecvGrad,
    SendAct,
    SendGrad,
    parse_action,
)

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
