"""Gantt rendering of modelled and measured pipeline timelines (flotilla.report.gantt)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from flotilla.core.errors import ConfigError
from flotilla.pipeline.schedule import (
    Backward,
    Forward,
    OptimizerStep,
    RecvGrad,
    SendAct,
    gpipe,
    one_f_one_b,
    pipedream,
)
from flotilla.pipeline.validate import modelled_timeline
from flotilla.report.gantt import classify, render_gantt

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert (
        data[:8] == PNG_MAGIC and data[12:16] == b"IHDR" and data.rstrip(b"\x00").endswith(b"IEND\xaeB`\x82")
    )
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize(
    "schedule",
    [gpipe(3, 6), one_f_one_b(3, 6), pipedream(3, 8), pipedream(2, 4, vertical_sync=True)],
    ids=["gpipe", "1f1b", "pipedream", "pipedream_vsync"],
)
def test_renders_each_schedule(tmp_path: Path, schedule) -> None:
    timeline = modelled_timeline(schedule, forward_s=1.0, backward_s=2.0, comm_s=0.25, optimizer_s=0.1)
    out = render_gantt(
        timeline, tmp_path / "g" / "chart.png", title=f"{schedule.kind.value} p={schedule.num_stages}"
    )
    width, height = _png_size(out)
    assert out == tmp_path / "g" / "chart.png"
    assert width > 300 and height > 100
    assert not list((tmp_path / "g").glob(".*.tmp"))  # atomic write leaves no temporary


def test_renders_measured_timeline_with_labels(tmp_path: Path) -> None:
    measured = [
        (0, "forward 0", 0.0, 0.5),
        (1, "F0@v0", 0.6, 1.1),
        (1, "backward 0", 1.1, 2.0),
        (0, "B0@v0", 2.1, 3.0),
        (0, "optimizer", 3.0, 3.2),
        (1, "send grad 0", 2.0, 2.1),
    ]
    width, height = _png_size(render_gantt(measured, tmp_path / "m.png", num_stages=2, show_comm=False))
    assert width > 0 and height > 0


def test_classify() -> None:
    assert classify(Forward(3, 0)) == ("forward", 3)
    assert classify(Backward(4, 1)) == ("backward", 4)
    assert classify(OptimizerStep(0, 1)) == ("update", None)
    assert classify(SendAct(2, 1)) == ("send", 2)
    assert classify(RecvGrad(5, 2)) == ("recv", 5)
    assert classify("B7@v2") == ("backward", 7)
    assert classify("Forward mb 12") == ("forward", 12)
    assert classify("update") == ("update", None)
    assert classify("checkpoint") == ("other", None)


def test_rejects_bad_timelines(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="empty"):
        render_gantt([], tmp_path / "x.png")
    with pytest.raises(ConfigError, match="end_s >= start_s"):
        render_gantt([(0, Forward(0, 0), 2.0, 1.0)], tmp_path / "x.png")
