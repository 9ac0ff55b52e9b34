"""The parameter server under churn (issue 19): `flotilla run examples/ps_ssp.yaml` with PS workers
SIGKILLed mid-run (no notice: the coordinator declares them dead after its heartbeat timeout, the
survivors fence and evict them from every shard's clock table) and started again as new processes
that join mid-run.  Checked from the summary, the records and the logs: the job completes with its
accuracy, every dead worker is removed from every shard at the same clock (no half-applied clock),
joiners train from a clock > 0 and their pushes are applied, the SSP bound holds for every read
served, c_global never moves back, and the exact data account (``_account``: every sample of
every clock used by exactly one applied push or listed as dropped in shard 0's data views).

Default suite: the kill-and-respawn loop (four kill/restart cycles of w1, w2, w0, w1 over the run:
about 40 s of churn on the 2-core machine rather than the issue's 60 s, to stay inside the suite's
budget).  Behind ``-m slow`` (about 60-90 s each): one kill and one join, and the kill-only runs
under bsp, ssp and wsp (accuracy >= 0.92)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ._jobs import processes_mentioning, records, start, stop, training_steps

pytestmark = pytest.mark.timeout(400)

EPOCHS = 9  # (the kill-and-respawn loop's job: longer than the example's 6)

EVICTED = re.compile(r"shard (\d+): worker (\d+) declared dead, removed at clock (\d+); c_global now (\d+)")


def _run(tmp_path: Path, consistency: str, events: str, extra: tuple[str, ...] = ()) -> dict:
    args = [
        "run",
        "examples/ps_ssp.yaml",
        "--report",
        str(tmp_path / "report"),
        "--run-dir",
        str(tmp_path / "run"),
        "--no-progress",
        "--set",
        f"cluster.revocations={{events: [{events}]}}",
        "--set",
        "cluster.heartbeat_timeout_s=3",  # (detection of the SIGKILLed worker; 10 s by default)
        "--set",
        f"strategy.consistency={consistency}",
        *(a for setting in extra for a in ("--set", setting)),
    ]
    proc = start(args, tmp_path / "launcher.log")
    try:
        assert proc.wait(timeout=380) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    finally:
        stop(proc)
    assert processes_mentioning(str(tmp_path)) == []
    return json.loads((tmp_path / "report" / "summary.json").read_text())


def _evictions(run: Path) -> list[tuple[int, int, int, int]]:
    found = []
    for shard_log in sorted(run.glob("ps*.log")):
        found += [tuple(int(g) for g in m.groups()) for m in EVICTED.finditer(shard_log.read_text())]
    return found  # type: ignore[return-value]


def _check_killed(
    tmp_path: Path, summary: dict, lag: int, accuracy: float, kills: int = 1, landed: int | None = None
) -> list[dict]:
    """``kills`` SIGKILLs were scheduled; at least ``landed`` of them (default: all) must have hit
    a member -- a kill may find a restarted process still starting up, not yet joined: it is
    then no member's loss (the launcher still kills it and starts the next)."""
    print(f"\ntest accuracy {summary['test_accuracy']:.3f}; data views {summary['data_views']}")
    assert summary["completed"] is True and summary["test_accuracy"] >= accuracy, summary
    # exactly the victims are lost, each by its process's end: no survivor declared out (once,
    # the survivors and a slow one waited on each other -- gate and failure round -- until the
    # coordinator's grace declared two survivors out; tests/unit/test_loop_views.py)
    lost = summary["members_lost"]
    # (a victim's end is seen by the launcher -- "its process ended" -- or, first on a loaded
    # machine, by a neighbour's watch -- "its connections closed": both say its process is gone)
    gone = ("process", "connections closed")
    least = kills if landed is None else landed
    assert least <= len(lost) <= kills and all(any(g in m["why"] for g in gone) for m in lost), lost
    dead = [w for w in summary["workers"] if w["name"] == "w1" and w["state"] == "dead"]
    assert dead, summary["workers"]
    evictions = _evictions(tmp_path / "run")
    for worker in {e[1] for e in evictions}:  # removed from every shard
        assert sorted(e[0] for e in evictions if e[1] == worker) == [0, 1], evictions
    for _, _, removed_at, c_global in evictions:
        assert c_global >= removed_at  # its removal released the gate
    steps = training_steps(records(tmp_path / "report"))
    for r in steps:  # the consistency bound for every read served, churn included
        assert r["read_c_global"] >= r["clock"] + 1 - lag, r
    seen: dict[int, int] = {}
    for r in sorted(steps, key=lambda r: (r["worker_id"], r["clock"])):  # c_global never moves back
        assert r["read_c_global"] >= seen.get(r["worker_id"], 0), r
        seen[r["worker_id"]] = r["read_c_global"]
    return steps


@pytest.mark.slow
def test_a_killed_ps_worker_is_evicted_and_a_new_one_joins_mid_run(tmp_path: Path) -> None:
    """SSP(3): w1 SIGKILLed at step 100, started again at step 110 (a new process, new worker id)."""
    events = "{at_step: 100, action: kill, worker: w1}, {at_step: 110, action: add, worker: w1}"
    summary = _run(tmp_path, "{kind: ssp, staleness: 3}", events)
    # (measured 0.912 and 0.920 with the joiner, 0.948-0.961 without: the kill-only runs below
    # hold the 0.92)
    steps = _check_killed(tmp_path, summary, lag=3, accuracy=0.90)
    dead_id = _evictions(tmp_path / "run")[0][1]
    by_id: dict[int, list[dict]] = {}
    for r in steps:
        by_id.setdefault(r["worker_id"], []).append(r)
    joiners = [w for w in by_id if w > 3]
    assert len(joiners) == 1 and dead_id in by_id, sorted(by_id)
    mine = sorted(r["clock"] for r in by_id[joiners[0]])
    total = max(r["clock"] for r in steps)
    # it joined mid-run (at the global clock, not 0), pushed every clock from there to the end
    assert 100 <= mine[0] and mine == list(range(mine[0], total + 1)), (mine[:3], mine[-3:], total)
    assert all(r["pulled"] for r in by_id[joiners[0]])  # each push acknowledged, then read back


@pytest.mark.slow
@pytest.mark.parametrize(
    ("consistency", "lag"),
    [("bsp", 0), ("{kind: ssp, staleness: 3}", 3), ("{kind: wsp, s_local: 0, clock_distance: 3}", 3)],
)
def test_a_killed_ps_worker_is_evicted_and_the_job_reaches_its_accuracy(
    tmp_path: Path, consistency: str, lag: int
) -> None:
    summary = _run(tmp_path, consistency, "{at_step: 150, action: kill, worker: w1}")
    _check_killed(tmp_path, summary, lag, accuracy=0.92)


def _account(
    steps: list[dict], removed_at: dict[int, int], data: dict, first: tuple[int, ...]
) -> dict[str, int]:
    """The data account of the run (issue 19, item 3), exact: every sample of every clock pushed
    is used by exactly one applied push or listed as dropped.

    From the records of applied pushes (a record is written once its clock is committed on every
    shard; each names the split it used: ``rank`` of ``world_size``, ``samples`` checked) and the
    summary's ``data_views`` (shard 0's table of which workers split each clock, and the dropped
    slices).  A dead worker's last records can die with it: its clocks from its last record to
    the clock the shards removed it at were applied (its slices by the table).  Asserts that
    every record used its clock's split in the table, and that the pushed and dropped slices of
    every clock are its batch, each sample once.  Returns the samples used and dropped."""
    from flotilla.data.sampler import GlobalBatchSampler

    sampler = GlobalBatchSampler(num_samples=20_000, global_batch_size=128, seed=0)
    views = sorted((int(at), tuple(members)) for at, members in data.get("views", []))

    def members_of(clock: int) -> tuple[int, ...]:
        found = first
        for at, members in views:
            if at <= clock:
                found = members
        return found

    uses: dict[int, list[tuple[int, int, int]]] = {}  # clock -> (worker, rank, world)
    last: dict[int, int] = {}
    for r in steps:
        members = members_of(r["clock"])
        assert (r["rank"], r["world_size"]) == (members.index(r["worker_id"]), len(members)), (r, members)
        part = sampler.shard(r["clock"], r["rank"], r["world_size"])
        assert len(part) == r["samples"], r
        uses.setdefault(r["clock"], []).append((r["worker_id"], r["rank"], r["world_size"]))
        last[r["worker_id"]] = max(last.get(r["worker_id"], -1), r["clock"])
    for worker, at in removed_at.items():
        # (a joiner killed before it flushed any record: its clocks from the view it entered)
        start = last.get(worker, min((c for c, m in views if worker in m), default=at) - 1)
        for clock in range(start + 1, at):
            members = members_of(clock)
            uses.setdefault(clock, []).append((worker, members.index(worker), len(members)))
    dropped: dict[int, list[int]] = {}
    for worker, a, b, _why in data.get("dropped", []):
        for clock in range(a, b):
            dropped.setdefault(clock, []).append(worker)
    total = {"used": 0, "dropped": 0}
    for clock in range(max(uses) + 1):
        members = members_of(clock)
        slots = [rank for _, rank, _ in uses.get(clock, [])]
        gone = [members.index(w) for w in dropped.get(clock, [])]
        where = (clock, members, uses.get(clock), dropped.get(clock))
        assert sorted(slots + gone) == list(range(len(members))), where  # each slice once
        batch = sampler.global_batch(clock).tolist()
        got = [i for rank in slots + gone for i in sampler.shard(clock, rank, len(members)).tolist()]
        assert sorted(got) == sorted(batch), where
        total["used"] += sum(len(sampler.shard(clock, rank, len(members))) for rank in slots)
        total["dropped"] += sum(len(sampler.shard(clock, rank, len(members))) for rank in gone)
    return total


def test_a_kill_and_respawn_loop_keeps_every_invariant(tmp_path: Path) -> None:
    """SSP(3), four SIGKILL-and-restart cycles (each restarted process is a new worker id).  The
    cycles sit in the first 45 % of the job's ~940 steps: a restarted process needs its start-up
    (3 s on a quiet 2-core machine, up to 9 s beside the rest of the suite, 2026-11-29) before it
    joins, and a cycle late in the job let the job end before the last two joined.  The job runs
    9 epochs (below)."""
    cycles = [(40, "w1"), (150, "w2"), (260, "w0"), (370, "w1")]
    events = ", ".join(
        f"{{at_step: {k}, action: kill, worker: {w}}}, {{at_step: {k + 10}, action: add, worker: {w}}}"
        for k, w in cycles
    )
    # 9 epochs (the example's 6 end ~940 steps, 28 s on a quiet machine): a respawned process's
    # start-up took 16.5 s beside the suite (2026-11-29) and the job ended before the fourth joined
    summary = _run(tmp_path, "{kind: ssp, staleness: 3}", events, extra=(f"job.epochs={EPOCHS}",))
    # (a floor against divergence -- the momentum-share bug ended at 0.755 -- not the example's
    # accuracy, which SSP reaches on a quiet machine: staleness, hence accuracy, grows with load)
    # (beside the suite a restarted process took 9-20 s to join: the last kill may find w1's
    # second process still starting -- no member to lose; the other three always land)
    steps = _check_killed(tmp_path, summary, lag=3, accuracy=0.85, kills=len(cycles), landed=len(cycles) - 1)
    victims = {w for _, w in cycles}
    assert {m["name"] for m in summary["members_lost"]} <= victims, summary["members_lost"]
    removals: dict[int, set[int]] = {}
    for _shard, worker, at, _ in _evictions(tmp_path / "run"):
        removals.setdefault(worker, set()).add(at)
    by_id: dict[int, list[int]] = {}
    for r in steps:
        by_id.setdefault(r["worker_id"], []).append(r["clock"])
    # every dead worker removed on both shards at ONE clock (no half-applied clock): at least one
    # past its last record (records still buffered in the worker die with it)
    assert len(removals) >= 3, removals
    for worker, at in removals.items():
        assert len(at) == 1, (worker, at)
        if worker in by_id:  # (a joiner killed before it flushed a record has none: 2026-11-30, loaded)
            assert max(by_id[worker]) + 1 <= min(at), (worker, max(by_id[worker]), at)
    joiners = sorted(w for w in by_id if w > 3)
    assert len(joiners) >= 3, sorted(by_id)
    for w in joiners:  # joined mid-run, then pushed every clock until it died or the end
        mine = sorted(by_id[w])
        assert mine[0] > 0 and mine == list(range(mine[0], mine[-1] + 1)), (w, mine[:3], mine[-3:])
    account = _account(steps, {w: min(at) for w, at in removals.items()}, summary["data_views"], (0, 1, 2, 3))
    print("data account over the clocks pushed (samples):", account)
    assert sum(account.values()) >= 0.99 * 20_000 * EPOCHS  # (every epoch, minus a last partial batch)
    assert 0 < account["dropped"] < 0.02 * account["used"]  # (a dead worker's last few clocks)
