"""``flotilla.sim.adpsgd``: AD-PSGD in virtual time.

Pure and fast (4-5 workers, no torch): bounds derived from the cost model without a straggler,
the straggler that all-reduce waits for and AD-PSGD does not, the real peer choice and
bipartition being the ones consulted (mutations), revocations and arrivals, determinism, bad input.
"""

from __future__ import annotations

import random
import re
import types
from collections.abc import Iterable
from dataclasses import replace

import pytest

import flotilla.sim.adpsgd as ad_sim
from flotilla.cluster.comm_cost import ring_allreduce_s, transfer_s
from flotilla.cluster.emulation import TransientSlowdown
from flotilla.cluster.spec import Link
from flotilla.sim.adpsgd import ADPSGDSpec, Exchange, adpsgd_of, simulate_adpsgd
from flotilla.sim.model import Change, DeviceClass, Recovery, SimCluster, SimJob, SimResult
from flotilla.sim.vote import simulate_vote

FOUR = SimCluster(classes=(DeviceClass(type="a", count=4),))  # one device per node: inter_node links
STRAGGLER = SimCluster(
    classes=(DeviceClass(type="fast", count=3), DeviceClass(type="slow", count=1, speed=1 / 3))
)
JOB = SimJob(steps=100, step_s=0.1, model_bytes=10_000_000, batch_per_worker=8)
T = transfer_s(JOB.model_bytes, FOUR.inter_node)  # one model over a link: 8.05 ms
T0 = transfer_s(0, FOUR.inter_node)  # an empty message: 50 us
EXCHANGE = 2 * T + 2 * T0  # prepare + average back + commit + its answer
BUSY = T + T0  # a prepare answered busy
CONSENSUS = ring_allreduce_s(4, JOB.model_bytes, FOUR.inter_node)
RECOVERY = Recovery(detect_s=0.2, startup_s=1.0)


def counts(r: SimResult) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", r.note)}


def test_without_a_straggler_the_time_lies_between_the_compute_and_an_exchange_every_step() -> None:
    record: list[Exchange] = []
    r = simulate_adpsgd(JOB, FOUR, record=record)
    n = counts(r)
    assert r.completed and n["exchanges"] == len(record) > 0 and n["aborted"] == 0
    # Lower bound: some worker trained all 100 steps and a step is at least its compute.  Upper:
    # a step is its compute plus at most one committed exchange plus one busy answer per busy
    # (a passive waits at most one prepared exchange, T + T0 < EXCHANGE), and a lagging worker
    # ends within its own steps.  Measured: 11.4999 s (bounds 10.012 .. 11.65).
    assert 100 * 0.1 + CONSENSUS < r.time_s <= 100 * (0.1 + EXCHANGE) + n["busy"] * BUSY + CONSENSUS + 1e-9
    # Rank 0 is always active (first in id order), so it pays an exchange per step and lags: it
    # ends when the others finished, before the job's 100 steps; the three others trained 100.
    assert r.steps < 100 and r.timeline[-1][1] == r.steps
    assert [c for _, c, _ in r.timeline] == list(range(1, r.steps + 1))
    assert r.samples == 8 * (3 * 100 + r.steps)
    # every committed exchange took exactly its modelled time; the actives alternate with passives
    assert all(x.done - x.t == pytest.approx(EXCHANGE, abs=1e-12) for x in record)
    assert {x.active for x in record[:20]} == {0, 2} and {x.passive for x in record[:20]} <= {1, 3}
    assert r.device_s == pytest.approx(4 * r.time_s) and r.recoveries_s == []


def test_a_straggler_does_not_pace_adpsgd_as_it_paces_all_reduce() -> None:
    ad = simulate_adpsgd(JOB, STRAGGLER)
    ar = simulate_vote(JOB, STRAGGLER)
    # measured 11.78 s vs 31.23 s (0.377; the runtime's benchmark: 8.9 s vs 24.6 s, 0.36)
    assert ad.completed and ar.completed
    assert ad.time_s < 0.7 * ar.time_s
    # the straggler (3x slower) trains far fewer steps than the fast workers' 100
    assert ad.samples < 8 * 4 * 100


def test_the_driver_consults_the_real_peer_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    real_choice = ad_sim.choose_peer
    real = simulate_adpsgd(JOB, FOUR)
    calls: list[int] = []

    def nobody(seed: int, me: int, step: int, attempt: int, among: tuple[int, ...]) -> int | None:
        calls.append(me)
        return None

    monkeypatch.setattr(ad_sim, "choose_peer", nobody)
    alone = simulate_adpsgd(JOB, FOUR)
    assert calls and counts(alone)["exchanges"] == 0 < counts(real)["exchanges"]
    # nobody averages: every worker computes its 100 steps back to back
    assert alone.time_s == pytest.approx(100 * 0.1 + CONSENSUS, rel=1e-9)
    assert alone.time_s < real.time_s

    # Every active starting with the same passive: on 4 identical workers the two actives fall
    # into step with each other after one busy answer and nothing changes (exchanges have one
    # fixed length); on 8 the four actives collide more.  Measured: real 371 exchanges, 9 busy,
    # 11.6347 s; mutated 367, 17, 11.6185 s.
    eight = SimCluster(classes=(DeviceClass(type="a", count=8),))
    monkeypatch.setattr(ad_sim, "choose_peer", real_choice)
    real8 = simulate_adpsgd(JOB, eight)

    def first(seed: int, me: int, step: int, attempt: int, among: tuple[int, ...]) -> int | None:
        return among[0] if among else None

    monkeypatch.setattr(ad_sim, "choose_peer", first)
    same = simulate_adpsgd(JOB, eight)
    assert counts(same)["busy"] > counts(real8)["busy"]
    assert counts(same)["exchanges"] != counts(real8)["exchanges"]
    assert same.time_s != real8.time_s and same.timeline != real8.timeline


def straggler_churn(record: list[Exchange]) -> SimResult:
    changes = [Change(3.0, True, "fast-1"), Change(4.0, False, "new-0")]
    return simulate_adpsgd(JOB, STRAGGLER, changes=changes, recovery=RECOVERY, record=record)


def test_every_exchange_pairs_an_active_with_a_passive() -> None:
    record: list[Exchange] = []
    r = straggler_churn(record)
    assert r.completed and record
    for x in record:  # the bipartition recomputed here: live members in id order alternate
        assert x.live.index(x.active) % 2 == 0 and x.live.index(x.passive) % 2 == 1, x
    # the roles did shift (a revocation, an arrival, workers finishing): not a fixed split
    assert {x.active for x in record} & {x.passive for x in record}


def test_the_bipartition_check_catches_a_wrong_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    def anyone(
        me: int, active: frozenset[int], passive: tuple[int, ...], suspected: Iterable[int] = ()
    ) -> tuple[int, ...]:
        out = {me, *suspected}  # every other live one, active or passive
        return tuple(m for m in sorted(active | set(passive)) if m not in out)

    monkeypatch.setattr(ad_sim, "candidates_of", anyone)
    record: list[Exchange] = []
    straggler_churn(record)
    assert any(x.live.index(x.active) % 2 == x.live.index(x.passive) % 2 for x in record)


def test_a_revocation_aborts_its_exchange_and_an_arrival_joins() -> None:
    plain: list[Exchange] = []
    simulate_adpsgd(JOB, FOUR, record=plain)
    x = next(x for x in plain if x.active == 2 and x.t > 3.0)
    kill_at = x.prepared_at + T / 2  # prepared on the passive, the commit not sent yet
    record: list[Exchange] = []
    r = simulate_adpsgd(JOB, FOUR, changes=[Change(kill_at, True, "a-2")], recovery=RECOVERY, record=record)
    assert r.completed and counts(r)["aborted"] == 1
    assert all(e.t < x.t for e in record if 2 in (e.active, e.passive))  # its last one never committed
    assert len(r.recoveries_s) == 1 and 0 < r.recoveries_s[0] < 0.1 + EXCHANGE
    assert r.timeline[-1][2] == 3

    ready_s = 4.0 + RECOVERY.startup_s
    joined: list[Exchange] = []
    both = simulate_adpsgd(
        JOB, FOUR, changes=[Change(kill_at, True, "a-2"), Change(4.0, False, "new-0")],
        recovery=RECOVERY, record=joined,
    )  # fmt: skip
    assert both.completed and both.timeline[-1][2] == 4 and both.device_s > r.device_s
    assert any(4 in (e.active, e.passive) and e.t > ready_s for e in joined)  # new-0 is worker 4
    # its request reaches rank 0 (the first lender in id order, free then) T0 after it is ready:
    # it starts at rank 0's step count then (43) and trains on to 100.  (The others train the
    # same steps with or without it -- measured 95, 100, 25 (revoked), 100 -- so the samples'
    # difference is the joiner's.)
    trained = (both.samples - r.samples) // 8
    lender_at = max(c for t, c, _ in both.timeline if t <= ready_s + T0)
    assert lender_at == 43 and trained == 100 - lender_at


def test_every_replica_lost_stops_incomplete() -> None:
    kills = [Change(2.0, True, f"a-{i}") for i in range(4)]
    r = simulate_adpsgd(JOB, FOUR, changes=kills, recovery=RECOVERY)
    assert not r.completed and r.time_s == 2.0 and "revoked" in r.note
    assert r.recoveries_s == [0.0]  # (one revocation instant: one recovery, never made)


def test_deterministic() -> None:
    slow = SimCluster(classes=FOUR.classes, slowdown=TransientSlowdown(p=0.2, factor=5, seed=1))

    def once() -> tuple[SimResult, list[tuple[float, int, int, float]]]:
        record: list[Exchange] = []
        r = simulate_adpsgd(
            JOB, slow, ADPSGDSpec(seed=7, attempts=3), changes=[Change(2.5, True, "a-1")],
            recovery=RECOVERY, record=record,
        )  # fmt: skip
        return r, [(x.t, x.active, x.passive, x.done) for x in record]

    (a, ra), (b, rb) = once(), once()
    assert a.summary() == b.summary() and ra == rb
    assert (a.timeline, a.recoveries_s, a.device_s) == (b.timeline, b.recoveries_s, b.device_s)
    other = simulate_adpsgd(JOB, slow, ADPSGDSpec(seed=8, attempts=3), changes=[Change(2.5, True, "a-1")])
    assert other.timeline != a.timeline  # the seed is the peer choice's


def test_bad_input_and_the_settings_hook() -> None:
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=r"ADPSGDSpec\.attempts"):
            ADPSGDSpec(attempts=bad)
    with pytest.raises(ValueError, match=r"ADPSGDSpec\.seed"):
        ADPSGDSpec(seed=-1)
    spec = adpsgd_of(types.SimpleNamespace(seed=3, attempts=4))
    assert spec == ADPSGDSpec(seed=3, attempts=4) and spec.name == "adpsgd"
    assert spec.simulate(JOB, FOUR).summary() == simulate_adpsgd(JOB, FOUR, spec).summary()


def test_random_runs_end_and_keep_the_bipartition() -> None:
    """Random clusters, sizes, slowdowns and changes: every run ends (no wait cycle, nothing
    left waiting), completes unless every replica was lost, and pairs actives with passives."""
    for seed in range(40):
        rng = random.Random(seed)
        cluster = SimCluster(
            classes=(
                DeviceClass(type="a", count=rng.randint(1, 6), per_node=rng.choice([1, 2])),
                DeviceClass(type="b", count=rng.randint(1, 3), speed=rng.choice([0.3, 2.0])),
            ),
            slowdown=TransientSlowdown(p=0.3, factor=4, seed=seed) if seed % 2 else None,
        )
        names = [d.name for d in cluster.devices()] + ["new-0", "new-1"]
        job = SimJob(steps=rng.randint(1, 40), step_s=rng.choice([0.005, 0.1]), model_bytes=10_000_000)
        changes = [Change(rng.uniform(0, 3), rng.random() < 0.6, rng.choice(names)) for _ in range(4)]
        record: list[Exchange] = []
        spec = ADPSGDSpec(seed=seed, attempts=rng.randint(1, 3))
        r = simulate_adpsgd(job, cluster, spec, changes=changes, recovery=RECOVERY, record=record)
        assert r.completed or "revoked" in r.note, (seed, r.summary())
        assert all(x.live.index(x.active) % 2 == 0 and x.live.index(x.passive) % 2 == 1 for x in record)


def test_every_exchange_message_pays_the_message_planes_own_cost() -> None:
    """AD-PSGD's exchanges travel on the message plane: with its calibrated cost, every committed
    exchange takes its four messages' worth more, exactly."""
    software = Link(bandwidth_gbps=5.0, latency_s=2e-4)
    record: list[Exchange] = []
    simulate_adpsgd(JOB, replace(FOUR, message_plane=software), record=record)
    more = 2 * transfer_s(JOB.model_bytes, software) + 2 * transfer_s(0, software)
    assert record and all(x.done - x.t == pytest.approx(EXCHANGE + more, abs=1e-12) for x in record)
