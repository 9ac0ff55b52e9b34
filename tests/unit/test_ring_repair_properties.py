"""Ring repair (``cluster/ring_repair.py``) driven by a small deterministic network simulator.

``Net`` holds one state machine per worker and a bag of messages in flight; a seeded schedule
picks which message is delivered next (any order), drops some (the senders re-send them when
``RetryDue`` fires), duplicates some, and fires timers at random moments.  A send to a dead
worker fails: the sender gets ``Suspect`` (what the driver reports after a failed send).  The
oracle is the naive reference: every survivor ends with the previous members minus the dead.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.cluster.membership import View
from flotilla.cluster.ring_repair import may_adopt_alone, start, step
from flotilla.cluster.ring_repair_messages import (
    ACK,
    COMMIT,
    PROBE,
    Adopt,
    Effect,
    Event,
    Evicted,
    Message,
    ProbeDue,
    Received,
    Rejected,
    RepairState,
    RetryDue,
    Send,
    Suspect,
)

MAX_EVENTS = 20_000


def reference(view: View, dead: set[int]) -> tuple[int, ...]:
    """The naive oracle: the previous members minus every dead worker."""
    return tuple(m for m in view.members if m not in dead)


def ring_successor(members: tuple[int, ...], w: int) -> int:
    return members[(members.index(w) + 1) % len(members)]


@dataclass
class Net:
    view: View
    dead: set[int]
    rng: random.Random
    drop: float = 0.0
    dup: float = 0.0
    probe: float = 0.0  # (per worker and timer round: the driver's probe while it waits for a view)
    states: dict[int, RepairState] = field(default_factory=dict)
    flight: list[tuple[int, Message]] = field(default_factory=list)
    adopted: dict[int, list[View]] = field(default_factory=dict)
    evicted: dict[int, View] = field(default_factory=dict)
    sent: int = 0
    log: list[Message] = field(default_factory=list)
    trace: list[tuple[int, View, frozenset[int]]] = field(default_factory=list)  # adopter, view, live
    rejected: list[Rejected] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.states = {w: start(w, self.view) for w in self.view.members}
        self.adopted = {w: [] for w in self.view.members}

    @property
    def live(self) -> list[int]:
        return [w for w in self.view.members if w not in self.dead]

    def apply(self, w: int, event: Event) -> None:
        if w in self.dead:
            return
        self.states[w], effects = step(self.states[w], event)
        for e in effects:
            self.effect(w, e)

    def effect(self, w: int, e: Effect) -> None:
        if isinstance(e, Send):
            assert e.message.sender == w
            self.sent += 1
            self.log.append(e.message)
            self.flight.append((e.dst, e.message))
        elif isinstance(e, Adopt):
            self.adopted[w].append(e.view)
            self.trace.append((w, e.view, frozenset(self.live)))
        elif isinstance(e, Evicted):
            self.evicted[w] = e.view
        else:
            self.rejected.append(e)

    def deliver_one(self) -> None:
        dst, m = self.flight.pop(self.rng.randrange(len(self.flight)))
        if self.rng.random() < self.dup:
            self.flight.append((dst, m))
        if dst in self.dead:  # the send fails: the driver tells the sender (a probe is only lost)
            if m.acked != PROBE:
                self.apply(m.sender, Suspect(frozenset({dst})))
        elif self.rng.random() >= self.drop:
            self.apply(dst, Received(m))

    def run(self, *, kills: dict[int, int] | None = None) -> int:
        """Deliver until quiescent (nothing in flight, a round of timers sends nothing).
        ``kills``: worker -> event number at which it dies (its ring predecessor then suspects
        it, as the neighbour watch would)."""
        kills = dict(kills or {})
        for n in range(MAX_EVENTS):
            for w, at in list(kills.items()):
                if at <= n:
                    del kills[w]
                    self.kill(w)
            if self.flight and self.rng.random() > 0.02:
                self.deliver_one()
                continue
            before = self.sent
            for w in self.live:
                if not self.adopted[w] and self.rng.random() < self.probe:  # (it waits for a view)
                    self.apply(w, ProbeDue())
                self.apply(w, RetryDue())
            if not self.flight and self.sent == before and not kills:
                return n
        raise AssertionError(f"no quiescence after {MAX_EVENTS} events")

    def kill(self, w: int) -> None:
        self.dead.add(w)
        live = [m for m in self.view.members if m not in self.dead]
        if live:
            before = [m for m in live if m < w]
            self.apply(before[-1] if before else live[-1], Suspect(frozenset({w})))


def detect_successors(net: Net) -> list[int]:
    """Every survivor whose successor died suspects it; returns these initiators."""
    initiators = [w for w in net.live if ring_successor(net.view.members, w) in net.dead]
    for w in initiators:
        net.apply(w, Suspect(frozenset({ring_successor(net.view.members, w)})))
    return initiators


def commit_initiators(net: Net) -> set[int]:
    return {s.last_commit.initiator for w, s in net.states.items() if w in net.live and s.last_commit}


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[View, set[int], int]:
    n = draw(st.integers(2, 12))
    ids = sorted(draw(st.sets(st.integers(0, 40), min_size=n, max_size=n)))
    view = View(epoch=draw(st.integers(0, 5)), members=tuple(ids))
    dead = set(draw(st.lists(st.sampled_from(ids), min_size=1, max_size=n - 1, unique=True)))
    return view, dead, draw(st.integers(0, 2**32 - 1))


@given(scenarios(), st.sampled_from([0.0, 0.3]), st.sampled_from([0.0, 0.2]), st.sampled_from([0.0, 0.5]))
@settings(max_examples=300, deadline=None)
def test_survivors_adopt_the_reference_view_once(
    scenario: tuple[View, set[int], int], drop: float, dup: float, probe: float
) -> None:
    """(With probes as well: a waiting worker's probe must never pass for the acknowledgement
    of a pass on its way back to it -- the ring-fault stall of session 42.)"""
    view, dead, seed = scenario
    net = Net(view=view, dead=set(dead), rng=random.Random(seed), drop=drop, dup=dup, probe=probe)
    initiators = detect_successors(net)
    net.run()
    expected = View(epoch=view.epoch + 1, members=reference(view, dead), left=tuple(sorted(dead)))
    for w in net.live:
        assert net.adopted[w] == [expected], (w, net.adopted[w])  # once, the reference
        assert net.states[w].view == expected and not net.states[w].dead
    assert not net.evicted and not [r for r in net.rejected if "conflicts" in r.reason]
    assert commit_initiators(net) == {min(initiators)}  # the lowest initiator's round won


@given(scenarios(), st.sampled_from([0.0, 0.3]))
@settings(max_examples=100, deadline=None)
def test_detection_interleaved_with_messages_still_agrees(
    scenario: tuple[View, set[int], int], drop: float
) -> None:
    view, dead, seed = scenario
    rng = random.Random(seed)
    net = Net(view=view, dead=set(dead), rng=rng, drop=drop)
    # detections arrive one by one, between deliveries
    detections = [w for w in net.live if ring_successor(view.members, w) in dead]
    rng.shuffle(detections)
    while detections or net.flight:
        if detections and (not net.flight or rng.random() < 0.3):
            w = detections.pop()
            net.apply(w, Suspect(frozenset({ring_successor(view.members, w)})))
        else:
            net.deliver_one()
    net.run()
    expected = reference(view, dead)
    for w in net.live:
        assert [v.members for v in net.adopted[w]] == [expected]


def count_messages(n: int, k: int, seed: int) -> tuple[int, int]:
    view = View(epoch=3, members=tuple(range(n)))
    rng = random.Random(seed)
    dead = set(rng.sample(range(n), k))
    net = Net(view=view, dead=dead, rng=rng)
    detect_successors(net)
    net.run()
    assert all([v.members for v in net.adopted[w]] == [reference(view, dead)] for w in net.live)
    return net.sent, sum(1 for m in net.log if m.kind != ACK)


def test_message_count_is_linear_in_n_times_k() -> None:
    """Without loss: at most 8·N·(K+1) messages (acks included) for K revocations among N."""
    print("\n   N   K  msgs  (non-ack)  msgs/(N(K+1))")
    worst = 0.0
    for n in (4, 8, 12, 24, 48):
        for k in sorted({1, 2, 3, n // 4, n // 2, n - 1}):
            if not 1 <= k < n:
                continue
            total, non_ack = max(count_messages(n, k, seed) for seed in range(10))
            ratio = total / (n * (k + 1))
            worst = max(worst, ratio)
            print(f"{n:4d} {k:3d} {total:5d} {non_ack:6d}      {ratio:5.2f}")
            assert total <= 8 * n * (k + 1)
    print(f"worst msgs/(N(K+1)) = {worst:.2f}")


@given(scenarios(), st.sampled_from([0.0, 0.3]))
@settings(max_examples=100, deadline=None)
def test_late_messages_of_a_finished_repair_change_nothing(
    scenario: tuple[View, set[int], int], drop: float
) -> None:
    view, dead, seed = scenario
    net = Net(view=view, dead=set(dead), rng=random.Random(seed), drop=drop)
    detect_successors(net)
    net.run()
    for w in net.live:
        before = net.states[w]
        for m in net.log:
            if m.sender == w:
                continue
            state, effects = step(before, Received(m))
            assert state == before
            assert not [e for e in effects if isinstance(e, (Adopt, Evicted))]
            # at most an ack of a duplicate commit or the commit for a straggler
            assert all(isinstance(e, (Send, Rejected)) for e in effects)
            sends = [e.message for e in effects if isinstance(e, Send)]
            assert all(s.kind in (ACK, COMMIT) for s in sends)


@given(scenarios(), st.integers(0, 400), st.sampled_from([0.0, 0.2]))
@settings(max_examples=150, deadline=None)
def test_a_death_during_the_repair_never_splits_the_survivors(
    scenario: tuple[View, set[int], int], when: int, drop: float
) -> None:
    """One more worker dies at a random moment of the repair (its ring predecessor notices):
    no two workers ever adopt different views for one epoch, and the survivors end together
    in a view of exactly the live workers."""
    view, dead, seed = scenario
    rng = random.Random(seed)
    survivors = [w for w in view.members if w not in dead]
    if len(survivors) < 2:
        return
    victim = rng.choice(survivors)
    net = Net(view=view, dead=set(dead), rng=rng, drop=drop)
    detect_successors(net)
    net.run(kills={victim: when})
    by_epoch: dict[int, set[tuple[int, ...]]] = {}
    for w in view.members:
        for v in net.adopted[w]:
            by_epoch.setdefault(v.epoch, set()).add(v.members)
        epochs = [v.epoch for v in net.adopted[w]]
        assert epochs == sorted(set(epochs))  # never twice, never backwards
    assert all(len(views) == 1 for views in by_epoch.values()), by_epoch
    final = {net.states[w].view for w in net.live}
    assert len(final) == 1 and final.pop().members == tuple(net.live)


@pytest.mark.parametrize("seed", range(20))
def test_the_initiator_dies_right_after_choosing(seed: int) -> None:
    """The race that makes a one-shot ACCEPT unsafe: the initiator adopts and dies with its
    COMMIT in flight (delivered or not); its predecessor takes over."""
    view = View(epoch=0, members=tuple(range(7)))
    rng = random.Random(seed)
    net = Net(view=view, dead={2}, rng=rng)
    detect_successors(net)  # worker 1 initiates
    while not net.adopted[1]:
        net.deliver_one()
    if rng.random() < 0.5:  # the first hop of its COMMIT is lost with it
        net.flight = [(d, m) for d, m in net.flight if m.sender != 1]
    net.kill(1)  # worker 0 notices
    net.run()
    for w in net.live:  # epoch 1 is the view the dead initiator chose; epoch 2 drops it
        assert net.states[w].view == View(epoch=2, members=(0, 3, 4, 5, 6), left=(1,))
        assert all(v.members == (0, 1, 3, 4, 5, 6) for v in net.adopted[w] if v.epoch == 1)


def test_a_wrongly_suspected_worker_is_evicted_and_told_so() -> None:
    view = View(epoch=4, members=(1, 2, 3, 4, 5))
    net = Net(view=view, dead=set(), rng=random.Random(0))
    net.apply(2, Suspect(frozenset({3})))  # 3 is alive, but 2 cannot reach it
    net.run()
    assert all([v.members for v in net.adopted[w]] == [(1, 2, 4, 5)] for w in (1, 2, 4, 5))
    assert not net.adopted[3] and 3 not in net.evicted
    net.apply(3, Suspect(frozenset({4})))  # 3's next collective fails; it tries a repair
    net.run()
    assert net.evicted[3].members == (1, 2, 4, 5)
    assert net.states[3].view == view  # it never adopted a view without itself
    assert all(len(net.adopted[w]) == 1 for w in (1, 2, 4, 5))  # nobody re-admitted it


@given(scenarios(), st.data())
@settings(max_examples=150, deadline=None)
def test_a_wrong_failure_detector_never_splits_majorities(
    scenario: tuple[View, set[int], int], data: st.DataObject
) -> None:
    """Live workers wrongly suspected at random moments, and more deaths, with loss: among the
    views the split-brain rule lets a worker run alone (``may_adopt_alone`` of the view before),
    two live workers never run different ones for the same epoch."""
    view, dead, seed = scenario
    rng = random.Random(seed)
    net = Net(view=view, dead=set(dead), rng=rng, drop=data.draw(st.sampled_from([0.0, 0.2])))
    survivors = net.live
    kills = {w: rng.randrange(300) for w in rng.sample(survivors, rng.randrange(len(survivors)))}
    detect_successors(net)
    for _ in range(data.draw(st.integers(1, 3)) if len(survivors) > 1 else 0):
        a, b = rng.sample(survivors, 2)
        for _ in range(rng.randrange(30)):
            if net.flight:
                net.deliver_one()
        net.apply(a, Suspect(frozenset({b})))
    net.run(kills=kills)
    running: dict[int, View] = {}
    held: set[int] = set()
    chosen: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    for w, v, live in net.trace:
        if w in held or not may_adopt_alone(running.get(w, view), v.members):
            held.add(w)  # the driver waits for the coordinator from here on
            continue
        running[w] = v
        for other, members in chosen.get(v.epoch, []):
            assert members == v.members or other not in live, (v.epoch, w, v.members, other, members)
        chosen.setdefault(v.epoch, []).append((w, v.members))
