"""A PS worker that joined mid-run shows the clock it joined at in summary.json and the summary table."""

from __future__ import annotations

from flotilla.launch.progress import summary_table
from flotilla.report.summary import worker_row

BASE = {"name": "w1", "speed": 1.0, "state": "left", "step": 941, "samples": 100, "busy_s": 2.0, "clock": 941}


def test_a_mid_run_joiner_shows_its_join_clock() -> None:
    joiner = worker_row({**BASE, "first_clock": 583})
    assert joiner["joined_at_clock"] == 583 and joiner["clock"] == 941
    assert "joined_at_clock" not in worker_row({**BASE, "first_clock": 0})  # an original worker


def test_the_summary_table_says_when_it_joined() -> None:
    table = summary_table({"workers": [worker_row({**BASE, "first_clock": 583})]})
    cells = [str(c) for col in table.columns for c in col._cells]
    assert any("joined at clock 583, clock 941" in c for c in cells), cells
