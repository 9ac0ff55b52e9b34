"""The chaos verdict (``report/chaos_check.py``) on tiny synthetic runs: a clean run with a kill
(lost records, a redo) and a restart passes every check, and each kind of damage makes exactly
the check it concerns fail -- a verdict that cannot fail would prove nothing."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

from flotilla.data.sampler import GlobalBatchSampler
from flotilla.report.chaos_check import ChaosLimits, check_chaos, percentile

SAMPLER = GlobalBatchSampler(num_samples=40, global_batch_size=8, seed=3)  # 5 steps per data epoch
TOTAL = 16
KILLED = 102  # SIGKILLed while committing step 5 (its records of steps 4-5 are lost)
STEP_S = 0.05


def _rec(pid: int, step: int, epoch: int, rank: int, world: int, t: float, **kw: Any) -> dict[str, Any]:
    rec = {
        "name": f"w{pid - 100}",
        "pid": pid,
        "step": step,
        "membership_epoch": epoch,
        "rank": rank,
        "world_size": world,
        "committed": True,
        "samples": len(SAMPLER.shard(step, rank, world)),
        "digest": f"d{step}",
        "time_s": t,
    }
    return {**rec, **kw}


def _discarded(pid: int, step: int, epoch: int, t: float) -> dict[str, Any]:
    return {
        "pid": pid,
        "step": step,
        "membership_epoch": epoch,
        "committed": False,
        "discarded": "x",
        "time_s": t,
    }


def _run() -> list[dict[str, Any]]:
    """Epoch 1: pids 100-102 run steps 0-5; 102 is killed in step 6 (its records of 4 and 5 never
    arrived), the survivors discard step 6 and redo it in epoch 2 (pids 100, 101); from step 10 a
    restarted pid 103 has joined (epoch 3)."""
    out: list[dict[str, Any]] = []
    t = 1.0
    for step in range(6):
        out += [
            _rec(pid, step, 1, pid - 100, 3, t)
            for pid in (100, 101, 102)
            if not (pid == KILLED and step >= 4)
        ]
        t += STEP_S
    out += [_discarded(100, 6, 1, t), _discarded(101, 6, 1, t)]
    t += 0.5  # the recovery
    for step in range(6, 10):
        out += [_rec(pid, step, 2, pid - 100, 2, t) for pid in (100, 101)]
        t += STEP_S
    t += 0.3  # the newcomer's state transfer
    for step in range(10, TOTAL):
        out += [_rec(pid, step, 3, i, 3, t) for i, pid in enumerate((100, 101, 103))]
        t += STEP_S
    return out


def _limits(**kw: Any) -> ChaosLimits:
    return ChaosLimits(
        **{
            "total_steps": TOTAL,
            "sampler": SAMPLER,
            "max_gap_s": 1.0,
            "killed_pids": frozenset({KILLED}),
            **kw,
        }
    )


def _failed(records: list[dict[str, Any]], **kw: Any) -> set[str]:
    verdict = check_chaos(records, _limits(**kw))
    return {c.name for c in verdict.checks if not c.ok}


def test_a_clean_run_with_a_kill_and_a_restart_passes() -> None:
    verdict = check_chaos(_run(), _limits())
    assert verdict.ok, verdict.report()
    assert verdict.explained_shards == 2  # pid 102's lost records of steps 4 and 5
    assert verdict.orphans == ()
    assert verdict.max_gap_step == 6 and verdict.max_gap_s == pytest.approx(0.5 + STEP_S)


def test_a_step_committed_after_a_later_one_fails_steps_increase() -> None:
    records = _run()
    records.append(_rec(100, 12, 3, 0, 3, 99.0))  # pid 100 commits step 12 again, at the end
    assert "steps_increase" in _failed(records)


def test_a_step_first_committed_out_of_order_fails_steps_increase() -> None:
    records = [r for r in _run() if r["step"] != 8]
    records += [_rec(pid, 8, 2, pid - 100, 2, 0.5) for pid in (100, 101)]  # before step 0
    assert "steps_increase" in _failed(records)


def test_a_gap_fails_every_step_once() -> None:
    records = [r for r in _run() if r["step"] != 7]
    assert "every_step_once" in _failed(records)


def test_a_short_run_fails_every_step_once() -> None:
    assert _failed(_run(), total_steps=TOTAL + 1) == {"every_step_once"}


def test_a_step_committed_in_two_epochs_by_live_replicas_fails() -> None:
    records = _run()
    # pid 101 committed step 6 in epoch 1 (and lived on); the survivors also redo it in epoch 2
    records.append(_rec(101, 6, 1, 1, 3, 1.31))
    records.sort(key=lambda r: (r["pid"], r["time_s"]))
    assert "every_step_once" in _failed(records)


def test_a_killed_replicas_last_commit_redone_by_the_survivors_is_an_orphan() -> None:
    records = _run()  # pid 102's records arrived up to its last commit, of step 6 in epoch 1
    records += [_rec(KILLED, step, 1, 2, 3, 1.0 + step * STEP_S) for step in (4, 5)]
    records.append(_rec(KILLED, 6, 1, 2, 3, 1.31, digest="other"))  # its state died with it
    verdict = check_chaos(records, _limits())
    assert verdict.ok, verdict.report()
    assert verdict.orphans == ((KILLED, 6),)
    # the same record from a process that was NOT killed is a step committed twice
    assert "every_step_once" in _failed(records, killed_pids=frozenset())


def test_different_digests_fail() -> None:
    records = _run()
    records[-1] = {**records[-1], "digest": "diverged"}
    assert _failed(records) == {"identical_digests"}


def test_a_missing_digest_fails_when_one_was_due() -> None:
    records = _run()
    del records[5]["digest"]
    assert _failed(records) == {"identical_digests"}
    assert _failed(records, digest_every_steps=0) == set()  # none due: nothing to compare


def test_a_shard_of_the_wrong_size_fails_samples_once() -> None:
    records = _run()
    records[3] = {**records[3], "samples": records[3]["samples"] + 1}
    assert _failed(records) == {"samples_once"}


def test_two_records_of_one_rank_fail_samples_once() -> None:
    records = _run()
    records.append({**records[0], "pid": 100, "rank": 1, "time_s": 1.0})  # rank 1 twice at step 0
    assert "samples_once" in _failed(records)


def test_a_missing_rank_without_explanation_fails_samples_once() -> None:
    # pid 102 was NOT killed: its missing records of steps 4-5 are unexplained
    assert _failed(_run(), killed_pids=frozenset()) == {"samples_once"}
    # a live replica's rank missing from a committed step
    records = [r for r in _run() if not (r["pid"] == 101 and r["step"] == 12)]
    assert _failed(records) == {"samples_once"}


def test_a_rank_whose_vote_broke_is_rolled_forward() -> None:
    records = [r for r in _run() if not (r["pid"] == 101 and r["step"] == 9)]
    records.append(_discarded(101, 9, 2, 1.7))
    assert check_chaos(records, _limits()).ok


def test_a_sampler_that_reuses_samples_fails_samples_once() -> None:
    class Overlapping(GlobalBatchSampler):
        """Each shard has the right size but takes rank 0's samples."""

        def shard(self, step: int, rank: int, world_size: int) -> np.ndarray:
            size = len(super().shard(step, rank, world_size))
            return super().shard(step, 0, world_size)[:size]

    bad = Overlapping(num_samples=40, global_batch_size=8, seed=3)
    verdict = check_chaos(_run(), _limits(sampler=bad))
    assert {c.name for c in verdict.checks if not c.ok} == {"samples_once"}
    assert "used twice" in verdict.check("samples_once").detail


def test_a_long_gap_fails_no_hang() -> None:
    assert _failed(_run(), max_gap_s=0.4) == {"no_hang"}
    records = copy.deepcopy(_run())
    for r in records:
        if r["step"] >= 12:
            r["time_s"] += 5.0  # a hang of 5 s before step 12
    verdict = check_chaos(records, _limits())
    assert not verdict.check("no_hang").ok and verdict.max_gap_step == 12


def test_percentile() -> None:
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.95) == pytest.approx(3.85)
    assert percentile([5.0], 0.95) == 5.0
    with pytest.raises(ValueError):
        percentile([], 0.5)
