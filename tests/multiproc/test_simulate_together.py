"""``flotilla simulate`` measures a job's emulated devices together (``cli/simulate_together.py``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from flotilla.cli.simulate_inputs import _together
from flotilla.cli.simulate_together import MAX_PROCESSES, run_together, summarise
from flotilla.config.load import load_config
from flotilla.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny.yaml"


def _cfg(speeds: list[float]) -> object:
    workers = ", ".join(f"{{name: w{i}, speed: {s}}}" for i, s in enumerate(speeds))
    overrides = [f"cluster.num_workers={len(speeds)}", f"cluster.workers=[{workers}]"]
    return load_config(TINY, [*overrides, "strategy={kind: allreduce}"])


def test_two_devices_measured_at_once_are_never_faster_than_their_speed() -> None:
    ran = run_together(_cfg([0.5, 0.25]), [0.5, 0.25], step_s=1e-9, seconds=0.5)
    assert set(ran.effective) == {0.5, 0.25}
    # step_s far below any real step: the effective speeds are capped at the nominal ones
    assert ran.effective == {
        0.5: pytest.approx(1e-9 / ran.median_s[0.5]),
        0.25: pytest.approx(1e-9 / ran.median_s[0.25]),
    }
    assert all(n >= 5 for n in ran.steps), ran.steps
    # the emulator stretched every step: the slower device's steps last longer
    assert ran.median_s[0.25] > ran.median_s[0.5] > 0
    assert ran.sigma >= 0 and math.isfinite(ran.sigma)


def test_a_device_that_cannot_run_is_one_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"emulated device 1 failed: ValueError: speed must be > 0"):
        run_together(_cfg([0.5, 0.5]), [0.5, 0.0], step_s=1e-3, seconds=0.2)


def test_the_summary_is_the_median_and_the_log_spread() -> None:
    times = [[2.0, 2.0, 2.0, 4.0], [1.0, 1.0, 1.0, 1.0]]
    got = summarise([0.25, 0.5], times, step_s=0.4)
    assert got.median_s == {0.25: 2.0, 0.5: 1.0}
    assert got.effective == {0.25: pytest.approx(0.2), 0.5: pytest.approx(0.4)}
    # |log(t / median)|: six zeros and log 2 -> median 0
    assert got.sigma == 0.0
    spread = summarise([0.5], [[1.0, 2.0, 0.5]], step_s=0.1)
    assert spread.sigma == pytest.approx(1.4826 * math.log(2.0))
    assert summarise([0.5], [[0.1]], step_s=1.0).effective == {0.5: 0.5}  # (never above the speed)
    with pytest.raises(ConfigError, match="timed no step"):
        summarise([0.5], [[]], step_s=1.0)


def test_only_a_data_parallel_job_of_local_devices_is_measured_together() -> None:
    cfg = _cfg([0.5, 0.25, 0.25])
    assert _together(cfg, None, [0.5, 0.25, 0.25])
    assert _together(cfg, 3, [0.5, 0.25, 0.25])
    assert not _together(cfg, 64, [0.5, 0.25, 0.25])  # (scaled: not what runs here)
    assert not _together(cfg, None, [0.5] * (MAX_PROCESSES + 1))
    assert not _together(cfg, None, [0.5])
    pipe = load_config(ROOT / "examples" / "pipeline_lm.yaml")
    assert not _together(pipe, None, [0.5, 0.25])
    with pytest.raises(ValueError, match="1 to 16 devices"):
        run_together(cfg, [], step_s=1e-3)
