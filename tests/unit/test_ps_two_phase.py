"""The two-phase push rules (``ps/two_phase.py``): over random interleavings of a worker's stages
and commits to several shards, message deliveries in any order across shards (FIFO per
connection), the worker's death at any point (or a live worker declared dead: a zombie whose
messages still arrive), fences and the eviction's resolution, every shard ends with the same
committed clock for the worker: a clock is applied on every shard or on none."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.ps.clock_rules import Refused
from flotilla.ps.two_phase import NONE, commit_verdict, resolution_target, resolve_verdict, stage_verdict


@dataclass
class Shard:
    recorded: int = 0
    staged: int = NONE
    fenced: bool = False
    applied: list[int] = field(default_factory=list)  # clocks applied, in order

    def deliver(self, op: str, clock: int) -> bool:
        """Process one message; True if it was acknowledged."""
        try:
            if op == "stage":
                if stage_verdict(0, self.recorded, self.staged, clock, fenced=self.fenced) != "done":
                    self.staged = clock
            elif commit_verdict(0, self.recorded, self.staged, clock, fenced=self.fenced) == "apply":
                self.applied.append(clock)
                self.recorded, self.staged = clock + 1, NONE
        except Refused:
            return False
        return True


@dataclass
class Worker:
    """Sends stage c to every shard, waits for every ack, sends commit c to every shard, waits
    for every ack, then clock c + 1 (the client's order, ``ps/client.py``)."""

    shards: int
    clock: int = 0
    phase: str = "stage"
    sent: set[int] = field(default_factory=set)
    acked: set[int] = field(default_factory=set)
    alive: bool = True

    def sendable(self) -> list[int]:
        return [s for s in range(self.shards) if s not in self.sent] if self.alive else []

    def ack(self, s: int) -> None:
        self.acked.add(s)
        if len(self.acked) == self.shards:  # every shard acknowledged this phase
            self.sent, self.acked = set(), set()
            self.phase, self.clock = (
                ("commit", self.clock) if self.phase == "stage" else ("stage", self.clock + 1)
            )


@settings(max_examples=400, deadline=None)
@given(
    num_shards=st.integers(2, 4),
    choices=st.lists(st.integers(0, 1000), min_size=1, max_size=120),
    zombie=st.booleans(),
)
def test_a_clock_is_applied_on_every_shard_or_on_none(
    num_shards: int, choices: list[int], zombie: bool
) -> None:
    shards = [Shard() for _ in range(num_shards)]
    queues: list[deque[tuple[str, int]]] = [deque() for _ in range(num_shards)]
    worker = Worker(num_shards)
    fenced_at: int | None = None
    for i, pick in enumerate(choices):
        action = pick % 4
        if action == 0 and worker.sendable():  # the worker sends its next message to a shard
            s = worker.sendable()[pick // 4 % len(worker.sendable())]
            worker.sent.add(s)
            queues[s].append((worker.phase, worker.clock))
        elif action == 1:  # a shard processes the oldest message on its connection
            s = pick // 4 % num_shards
            if queues[s]:
                op, clock = queues[s].popleft()
                if (
                    shards[s].deliver(op, clock)
                    and worker.alive
                    and (op, clock) == (worker.phase, worker.clock)
                ):
                    worker.ack(s)
        elif action == 2 and fenced_at is None:  # the coordinator declares the worker dead
            worker.alive = zombie and worker.alive  # a zombie keeps sending what it can
            fenced_at = i
        elif action == 3 and fenced_at is not None:  # the evicting party fences one more shard
            shards[pick // 4 % num_shards].fenced = True
    if fenced_at is None:
        worker.alive = False
    for s in shards:  # eviction: fence every shard, collect, resolve
        s.fenced = True
    target = resolution_target(s.recorded for s in shards)
    for s in shards:
        if resolve_verdict(s.recorded, s.staged, target) == "commit":
            s.applied.append(s.staged)
            s.recorded = s.staged + 1
        s.staged = NONE
    for s, q in zip(shards, queues):  # late messages (a zombie's, or in flight) are all refused
        while q:
            assert not s.deliver(*q.popleft())
    assert len({s.recorded for s in shards}) == 1, [s.recorded for s in shards]
    assert all(s.applied == list(range(target)) for s in shards)


def test_rules_refuse_what_the_protocol_never_sends() -> None:
    assert stage_verdict(0, 5, NONE, 5, fenced=False) == "stage"
    assert stage_verdict(0, 5, 5, 5, fenced=False) == "restage"
    assert stage_verdict(0, 5, NONE, 4, fenced=False) == "done"
    assert commit_verdict(0, 5, 5, 5, fenced=False) == "apply"
    assert commit_verdict(0, 6, NONE, 5, fenced=False) == "done"
    for bad in (6, 3, "5", None):
        with pytest.raises(Refused) as err:
            stage_verdict(0, 5, NONE, bad, fenced=False)
        assert err.value.code == "bad_clock"
    with pytest.raises(Refused) as err:
        commit_verdict(0, 5, NONE, 5, fenced=False)
    assert err.value.code == "not_staged"
    with pytest.raises(Refused) as err:
        stage_verdict(0, 5, NONE, 5, fenced=True)
    assert err.value.code == "unknown_worker"
    assert resolve_verdict(5, 5, 6) == "commit" and resolve_verdict(5, 5, 5) == "discard"
    assert resolve_verdict(6, NONE, 6) == "discard"
    for recorded, staged, target in ((5, NONE, 6), (4, 4, 6)):
        with pytest.raises(Refused) as err:
            resolve_verdict(recorded, staged, target)
        assert err.value.code == "half_applied"
    assert resolution_target([3, 4, 3]) == 4
    with pytest.raises(ValueError):
        resolution_target([])
