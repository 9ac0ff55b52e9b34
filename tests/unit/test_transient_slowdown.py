"""Transient slowdowns in the emulation (SPEC §8): seeded, 'with probability p a step takes k x
longer' and log-normal jitter, applied like ``speed`` (sleep after measuring real compute)."""

from __future__ import annotations

import math

import pytest

from flotilla.cluster.emulation import SpeedEmulator, TransientSlowdown
from flotilla.config import validate_config

JOB = {"model": {"name": "mlp"}, "dataset": {"name": "mnist1d"}, "steps": 1, "epochs": None}


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.slept: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def run(emu: SpeedEmulator, clock: FakeClock, steps: int, compute_s: float = 0.01) -> list[float]:
    factors = []
    for _ in range(steps):
        emu.reset_counters()
        emu.start()
        clock.t += compute_s
        emu.mark()
        real, slept = emu.reset_counters()
        factors.append((real + slept) / real)
    return factors


def test_spikes_take_k_times_longer_with_probability_p_on_top_of_speed() -> None:
    clock = FakeClock()
    sd = TransientSlowdown(p=0.1, factor=5.0, seed=3)
    factors = run(SpeedEmulator(0.25, now=clock.now, sleep=clock.sleep, slowdown=sd), clock, 4000)
    assert set(round(f, 6) for f in factors) == {4.0, 20.0}
    share = sum(1 for f in factors if f > 4.5) / len(factors)
    assert 0.08 < share < 0.12
    clock2 = FakeClock()  # same seed: same sequence
    again = run(SpeedEmulator(0.25, now=clock2.now, sleep=clock2.sleep, slowdown=sd), clock2, 4000)
    assert again == factors


def test_lognormal_jitter_never_makes_a_step_shorter_than_its_compute() -> None:
    clock = FakeClock()
    sd = TransientSlowdown(jitter_sigma=0.5, seed=1)
    factors = run(SpeedEmulator(1.0, now=clock.now, sleep=clock.sleep, slowdown=sd), clock, 2000)
    assert min(factors) == pytest.approx(1.0)
    med = sorted(factors)[len(factors) // 2]
    assert 1.0 <= med < 1.1 and max(factors) > math.exp(1.0)  # half the draws are below 1: no sleep


def test_cluster_defaults_give_every_worker_a_seeded_slowdown() -> None:
    cfg = validate_config(
        {"cluster": {"num_workers": 2, "defaults": {"slowdown": {"p": 0.1, "factor": 5}}}, "job": JOB}
    )
    a, b = (TransientSlowdown.of(w.slowdown, i) for i, w in enumerate(cfg.cluster.resolved_workers()))
    assert a is not None and b is not None and a.p == 0.1 and a.factor == 5.0 and a.seed != b.seed
    with pytest.raises(Exception, match="factor"):
        validate_config({"cluster": {"defaults": {"slowdown": {"factor": 0.5}}}, "job": JOB})


def test_each_step_record_carries_its_emulated_slowdown_factor() -> None:
    clock = FakeClock()
    sd = TransientSlowdown(p=0.3, factor=4.0, jitter_sigma=0.2, seed=7)
    emu = SpeedEmulator(0.5, now=clock.now, sleep=clock.sleep, slowdown=sd)
    seen = []
    for _ in range(200):
        emu.reset_counters()
        emu.start()
        clock.t += 0.01
        emu.mark()
        real, slept = emu.reset_counters()
        f = emu.record_fields()["slowdown_factor"]
        # the step lasted max(f / speed, 1) x its compute: the record names f
        assert (real + slept) / real == pytest.approx(max(f / 0.5, 1.0), rel=1e-3)
        seen.append(f)
    assert min(seen) < 1.0 < 4.0 < max(seen)  # jitter both ways, and the spikes
    # a unit of two intervals: the factors weighted by each one's real compute
    emu.reset_counters()
    drawn = []
    for compute_s in (0.01, 0.03):
        emu.start()
        drawn.append(emu.factor)
        clock.t += compute_s
        emu.mark()
    emu.reset_counters()
    want = (0.01 * drawn[0] + 0.03 * drawn[1]) / 0.04
    assert emu.record_fields()["slowdown_factor"] == pytest.approx(want, abs=1e-4)
    # without a transient slowdown the records carry no such field
    assert SpeedEmulator(0.5, now=clock.now, sleep=clock.sleep).record_fields() == {}
