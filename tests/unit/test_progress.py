"""The live progress table and the end-of-run summary table of `flotilla run`."""

from __future__ import annotations

from rich.console import Console

from flotilla.launch.progress import status_table, summary_table


def _render(table) -> str:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def _snap(strategy: str, **extra) -> dict:
    workers = [
        {
            "worker_id": i,
            "name": f"w{i}",
            "speed": 1.0,
            "state": "training",
            "step": 40 + i,
            "clock": 10 + i if strategy == "ps" else None,
            "samples_per_s": 100.0,
            "loss": 0.5,
            "membership_epoch": 1,
            "samples": 800,
        }
        for i in range(2)
    ]
    return {
        "workers": workers,
        "members": [0, 1],
        "evals": [],
        "epoch": 1,
        "elapsed_s": 3.0,
        "strategy": strategy,
        **extra,
    }


def test_ps_status_shows_the_coordinators_clock_spread_and_each_clock() -> None:
    table = status_table(_snap("ps", clock_spread=1, max_clock_spread=4), total_steps=100)
    assert "clock spread 1 (max 4)" in table.title  # not 41 - 40 from the step column
    lines = _render(table).splitlines()
    header = next(line for line in lines if line.startswith("┃"))
    assert [c.strip() for c in header.strip("┃ ").split("┃")][4:6] == ["step", "clock"]
    rows = [[c.strip() for c in line.strip("│ ").split("│")] for line in lines if "training" in line]
    assert [(r[4], r[5]) for r in rows] == [("40", "10"), ("41", "11")]


def test_no_clock_spread_or_clock_column_outside_ps() -> None:
    table = status_table(_snap("allreduce", clock_spread=None, max_clock_spread=None), 100)
    assert "clock" not in table.title and "clock" not in _render(table)


def test_summary_table_lists_max_clock_spread_and_each_workers_clock_and_rate() -> None:
    summary = {
        "completed": True,
        "test_accuracy": 0.95,
        "steps": 60,
        "strategy": "ps",
        "max_clock_spread": 3,
        "workers": [
            {"name": "w0", "speed": 1.0, "state": "done", "step": 59, "clock": 59, "samples_per_s": 1234.5}
        ],
    }
    text = _render(summary_table(summary))
    row = next(line for line in text.splitlines() if "max_clock_spread" in line)
    assert [c.strip() for c in row.strip("│ ").split("│")] == ["max_clock_spread", "3"]
    assert "speed 1.00, done, step 59, clock 59, 1,234 samples/s" in text


def test_sample_rate_is_measured_over_a_window_of_snapshots() -> None:
    from flotilla.launch.progress import SampleRate

    rate = SampleRate(window_s=3.0, min_s=1.0)
    snap = _snap("ps")
    for w in snap["workers"]:
        w["samples_per_s"] = 5000.0  # last-step rates: would sum to 10,000
    seen = []
    for i in range(25):  # 2 workers x 100 samples every 0.25 s
        for w in snap["workers"]:
            w["samples"] = 100 * i
        snap["elapsed_s"] = 0.25 * i
        seen.append(rate.update(snap))
    assert seen[:4] == [None] * 4  # under 1 s of history
    assert all(r == 800.0 for r in seen[4:])
    table = status_table(snap, 100, seen[-1])
    assert table.title.startswith("step 41/100 ████████░░░░░░░░░░░░ 40%  800 samples/s")


def test_the_bar_and_the_eta_follow_the_slowest_training_worker() -> None:
    from flotilla.launch.progress import StepRate, clock_text, progress_bar, progress_step

    snap = _snap("ps")
    snap["workers"][1]["state"] = "done"
    snap["workers"][1]["step"] = 99
    assert progress_step(snap) == 40  # w0 still trains: the job ends with it
    eta = StepRate(window_s=10.0, min_s=2.0)
    seen = []
    for i in range(13):  # w0 makes 4 steps a second
        snap["workers"][0]["step"] = 40 + 2 * i
        snap["elapsed_s"] = 0.5 * i
        seen.append(eta.eta_s(snap, 100))
    assert seen[:4] == [None] * 4 and seen[-1] == (100 - 64) / 4.0
    table = status_table(snap, 100, 800.0, seen[-1])
    assert "elapsed 0:06  ETA 0:09" in table.title and progress_bar(64, 100, 10) == "██████░░░░ 64%"
    assert [clock_text(x) for x in (None, -1.0, float("nan"), 59.6, 3725.0)] == [
        "-",
        "-",
        "-",
        "1:00",
        "1:02:05",
    ]
    snap["workers"][0]["step"] = 64
    snap["elapsed_s"] = 20.0
    assert eta.eta_s(snap, 100) is None  # no step made in the window: unknown, not infinite
