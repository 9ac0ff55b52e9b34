"""The two-phase rules for a virtual worker's clock staged in parts (``ps/two_phase.py``,
"Parts"; issue 19 item 5): k stages each stage their part of the VW's clock on every shard (in
any order, over their own connections, FIFO per connection), commit once every part is staged on
every shard, stages die at random points, the coordinator declares the VW dead (its stages stop,
or go on as zombies whose messages still arrive), the evicting party fences shards one by one and
finally fences and resolves every shard.  Every shard ends with the same clock for the VW, and
every clock applied on a shard was applied with all of its parts (its chunks are the union)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.ps.clock_rules import Refused
from flotilla.ps.two_phase import (
    MAX_PARTS,
    NONE,
    Parts,
    commit_verdict,
    resolution_target,
    resolve_verdict,
    stage_part,
)


@dataclass
class Shard:
    chunks: list[frozenset[int]]  # part -> its chunks on this shard (disjoint; possibly empty)
    recorded: int = 0
    entry: Parts | None = None
    fenced: bool = False
    applied: list[tuple[int, frozenset[int]]] = field(default_factory=list)  # (clock, chunks)

    @property
    def staged(self) -> int:
        return NONE if self.entry is None else self.entry.staged

    def apply(self) -> None:
        assert self.entry is not None
        self.applied.append((self.entry.clock, frozenset().union(*self.entry.chunks.values())))
        self.recorded, self.entry = self.entry.clock + 1, None

    def deliver(self, op: str, clock: int, part: int) -> str | None:
        """Process one message of stage ``part``; None if acknowledged, else the refusal's code."""
        try:
            if op == "stage":
                verdict, parts = stage_part(
                    7,
                    self.recorded,
                    self.entry,
                    clock,
                    part,
                    len(self.chunks),
                    self.chunks[part],
                    fenced=self.fenced,
                )
                if verdict != "done":
                    self.entry = parts
            elif commit_verdict(7, self.recorded, self.staged, clock, fenced=self.fenced) == "apply":
                self.apply()
        except Refused as exc:
            return exc.code
        return None


@dataclass
class Stage:
    """One stage of the VW: stages clock c on every shard, waits for every ack, waits until every
    stage of the VW staged c (they coordinate among themselves), commits c on every shard, waits
    for every ack, then clock c + 1 (``ps/client_parts.py``)."""

    shards: int
    clock: int = 0
    phase: str = "stage"  # stage -> staged (waiting for the other stages) -> commit
    sent: set[int] = field(default_factory=set)
    acked: set[int] = field(default_factory=set)
    alive: bool = True

    def has_staged(self, clock: int) -> bool:
        return self.clock > clock or (self.clock == clock and self.phase != "stage")

    def ack(self, s: int) -> None:
        self.acked.add(s)
        if len(self.acked) == self.shards:
            self.sent, self.acked = set(), set()
            if self.phase == "stage":
                self.phase = "staged"
            else:
                self.phase, self.clock = "stage", self.clock + 1


class VWSim:
    """One VW of ``len(layout[0])`` stages and ``len(layout)`` shards, its messages in flight."""

    def __init__(self, layout: list[list[frozenset[int]]]) -> None:
        self.layout = layout
        self.shards = [Shard(chunks) for chunks in layout]
        self.stages = [Stage(len(layout)) for _ in layout[0]]
        self.queues = {
            (p, s): deque[tuple[str, int]]() for p in range(len(self.stages)) for s in range(len(layout))
        }

    def send(self, p: int, pick: int) -> None:
        """Stage ``p`` sends its next message to a shard it has not sent this phase to."""
        stage = self.stages[p]
        if stage.phase == "staged" and all(o.has_staged(stage.clock) for o in self.stages):
            stage.phase = "commit"  # every part is staged on every shard: the commit may go
        todo = [x for x in range(len(self.shards)) if x not in stage.sent]
        if stage.alive and stage.phase != "staged" and todo:
            s = todo[pick % len(todo)]
            stage.sent.add(s)
            self.queues[p, s].append((stage.phase, stage.clock))

    def deliver_any(self, pick: int) -> None:
        """Some shard processes the oldest message of some stage (``pick`` chooses the pair)."""
        busy = [key for key, q in self.queues.items() if q]
        if busy:
            self.deliver(*busy[pick % len(busy)])

    def deliver(self, p: int, s: int) -> None:
        """Shard ``s`` processes stage ``p``'s oldest message.  A commit refused ``not_staged``
        (the shard restarted and lost parts) sends every stage of that clock back to staging
        (``client_parts``: the VW's stages stage again before a commit)."""
        if not self.queues[p, s]:
            return
        op, clock = self.queues[p, s].popleft()
        code, stage = self.shards[s].deliver(op, clock, p), self.stages[p]
        if not stage.alive or (op, clock) != (stage.phase, stage.clock):
            return
        if code is None:
            stage.ack(s)
        elif code == "not_staged":
            for o in self.stages:
                if o.clock == clock:
                    o.phase, o.sent, o.acked = "stage", set(), set()

    def resolve(self) -> int:
        """The eviction: fence every shard, resolve to the highest committed clock; late messages
        are then all refused."""
        for shard in self.shards:
            shard.fenced = True
        target = resolution_target(shard.recorded for shard in self.shards)
        for shard in self.shards:
            if resolve_verdict(shard.recorded, shard.staged, target) == "commit":
                shard.apply()
            shard.entry = None
        for (p, s), q in self.queues.items():
            while q:
                assert self.shards[s].deliver(*q.popleft(), p) is not None
        return target

    def check(self, target: int) -> None:
        """Every shard at ``target``, each clock below applied once with every part's chunks."""
        assert [shard.recorded for shard in self.shards] == [target] * len(self.shards)
        for s, shard in enumerate(self.shards):
            whole = frozenset().union(*self.layout[s])
            assert shard.applied == [(c, whole) for c in range(target)], (s, shard.applied)


def _layout(num_shards: int, num_parts: int, owners: list[int]) -> list[list[frozenset[int]]]:
    """Chunk ``i`` of the job lies on shard ``i % num_shards`` and belongs to part ``owners[i]``."""
    return [
        [
            frozenset(i for i, p in enumerate(owners) if i % num_shards == s and p % num_parts == part)
            for part in range(num_parts)
        ]
        for s in range(num_shards)
    ]


def _steps(rare: list[str]) -> st.SearchStrategy[list[tuple[str, int, int]]]:
    """(action, stage, shard) triples: mostly sends and deliveries, now and then a ``rare`` one."""
    action = st.sampled_from(["send"] * 19 + ["deliver"] * 19 + rare)
    return st.lists(st.tuples(action, st.integers(0, 2), st.integers(0, 8)), min_size=20, max_size=300)


LAYOUTS = {
    "num_shards": st.integers(2, 3),
    "num_parts": st.integers(2, 3),
    "owners": st.lists(st.integers(0, 2), min_size=2, max_size=8),
}


@settings(max_examples=150, deadline=None)
@given(**LAYOUTS, steps=_steps(["die", "declare", "fence", "fence"]), zombie=st.booleans())
def test_a_vw_clock_is_applied_with_all_its_parts_on_every_shard_or_on_none(
    num_shards: int, num_parts: int, owners: list[int], steps: list[tuple[str, int, int]], zombie: bool
) -> None:
    vw = VWSim(_layout(num_shards, num_parts, owners))
    declared = False
    for action, p, s in steps:
        pick, p, s = p * 9 + s, p % num_parts, s % num_shards
        if action == "send":
            vw.send(p, s)
        elif action == "deliver":
            vw.deliver_any(pick)
        elif action == "die":  # stage p dies
            vw.stages[p].alive = False
        elif action == "declare" and not declared:  # the coordinator declares the VW dead
            declared = True
            for o in vw.stages:
                o.alive = zombie and o.alive  # zombies keep sending what they can
        elif action == "fence" and declared:  # the evicting party fences one more shard
            vw.shards[s].fenced = True
    for o in vw.stages:
        o.alive = zombie and o.alive
    vw.check(vw.resolve())


@settings(max_examples=150, deadline=None)
@given(**LAYOUTS, steps=_steps(["deliver", "deliver", "restart"]))
def test_after_shard_restarts_a_vw_clock_is_committed_only_with_all_its_parts(
    num_shards: int, num_parts: int, owners: list[int], steps: list[tuple[str, int, int]]
) -> None:
    """Shards restart at random and lose the parts staged there (staged updates are volatile);
    a commit of an incomplete clock (one still in flight from before the restart, or sent
    while another stage stages again) must be refused, never apply some of the parts.  The VW
    then finishes its clock in progress and leaves."""
    vw = VWSim(_layout(num_shards, num_parts, owners))
    for action, p, s in steps:
        pick, p, s = p * 9 + s, p % num_parts, s % num_shards
        if action == "send":
            vw.send(p, s)
        elif action == "deliver":
            vw.deliver_any(pick)
        else:  # shard s restarts: its committed clocks are kept (snapshot), staged parts lost
            vw.shards[s].entry = None
    last = max(o.clock for o in vw.stages) + 1
    for _ in range(10_000):  # no more restarts: the stages finish clock ``last - 1``
        if all(o.clock == last for o in vw.stages) and not any(vw.queues.values()):
            break
        for p in range(num_parts):
            if vw.stages[p].clock < last:
                for s in range(num_shards):
                    vw.send(p, s)
            for s in range(num_shards):
                vw.deliver(p, s)
    else:
        pytest.fail("the VW did not finish its clock after the restarts")
    vw.check(vw.resolve())


def _parts(clock: int, count: int, **chunks: set[int]) -> Parts:
    return Parts(clock, count, {int(p[1:]): frozenset(c) for p, c in chunks.items()})


def test_parts_are_staged_replaced_and_complete_only_together() -> None:
    verdict, one = stage_part(0, 5, None, 5, 1, 2, [3, 4], fenced=False)
    assert verdict == "stage" and one == _parts(5, 2, p1={3, 4})
    assert one is not None and one.staged == NONE
    verdict, again = stage_part(0, 5, one, 5, 1, 2, [4], fenced=False)  # a retry replaces the part
    assert verdict == "restage" and again == _parts(5, 2, p1={4})
    verdict, both = stage_part(0, 5, one, 5, 0, 2, [], fenced=False)  # no chunk here: still a part
    assert verdict == "stage" and both is not None and both.complete and both.staged == 5
    assert stage_part(0, 6, None, 5, 0, 2, [1], fenced=False) == ("done", None)  # committed already
    with pytest.raises(Refused) as err:  # an incomplete clock cannot be committed
        commit_verdict(0, 5, one.staged, 5, fenced=False)
    assert err.value.code == "not_staged"
    assert resolve_verdict(5, one.staged, 5) == "discard"  # and a resolution discards it
    verdict, whole = stage_part(0, 5, None, 5, 0, 1, [1, 2], fenced=False)  # a plain ps.stage
    assert whole is not None and whole.staged == 5


@pytest.mark.parametrize(
    ("part", "parts", "chunks", "code"),
    [
        (2, 2, [9], "bad_part"),  # part >= parts
        (-1, 2, [9], "bad_part"),
        (0, 0, [9], "bad_part"),
        (0, MAX_PARTS + 1, [9], "bad_part"),
        (True, 2, [9], "bad_part"),
        (0, 3, [9], "bad_part"),  # another count than the staged part's
        (0, 2, [4, 9], "bad_key"),  # shares chunk 4 with part 1
        (0, 2, [9, 9], "bad_key"),
    ],
)
def test_bad_parts_are_refused(part: object, parts: object, chunks: list[int], code: str) -> None:
    held = _parts(5, 2, p1={3, 4})
    with pytest.raises(Refused) as err:
        stage_part(0, 5, held, 5, part, parts, chunks, fenced=False)
    assert err.value.code == code
    assert held == _parts(5, 2, p1={3, 4})
    with pytest.raises(Refused) as err:
        stage_part(0, 5, held, 5, 0, 2, [9], fenced=True)
    assert err.value.code == "unknown_worker"
    with pytest.raises(Refused) as err:
        stage_part(0, 5, held, 7, 0, 2, [9], fenced=False)
    assert err.value.code == "bad_clock"
