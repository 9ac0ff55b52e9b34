"""The data views of the PS (issue 19, item 3): ``ps/data_views.py`` and shard 0's clock rules.

The property test runs workers against shard 0's pure clock rules under random interleavings, in
the most asynchronous schedule a worker can follow (``sync/via_ps.py``: it starts clock j once
clock j - 2 is acknowledged, and sends clock j once j - 1 is), with deaths (evicted later, their
pushes in flight lost or applied), graceful leaves and joins.  Each worker splits every clock
with the newest table a reply gave it.  Checked at the end, for every clock all live workers
pushed: every applied push used the split of the final table, and every sample slot (rank) of
the clock's view is used by exactly one applied push or listed as dropped."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.ps import clock_rules, data_views
from flotilla.ps.clock_rules import Refused, ShardClocks
from flotilla.ps.data_views import DataView, DataViews, Dropped

pytestmark = pytest.mark.timeout(60)


@dataclass
class Sim:
    """One worker of the simulation."""

    wid: int
    first: int  # its first clock
    held: tuple[int, tuple[DataView, ...]] = (0, ())
    started: int = -1  # the last clock it started computing
    sent: int = -1  # the last clock it sent
    acked: int = -1  # the last clock acknowledged
    inflight: list[int] = field(default_factory=list)  # sent, not delivered
    delivered: list[int] = field(default_factory=list)  # delivered, not acknowledged
    alive: bool = True
    used: dict[int, tuple[int, int]] = field(default_factory=dict)  # clock -> (rank, world)

    def __post_init__(self) -> None:
        self.started = self.sent = self.acked = self.first - 1


class World:
    def __init__(self, n: int) -> None:
        self.state = ShardClocks(num_workers=n, keeps_views=True)
        self.first = tuple(range(n))
        self.workers: dict[int, Sim] = {}
        for w in range(n):
            self.state, at = clock_rules.hello(self.state, w, 0, resync=False)
            self.workers[w] = Sim(w, at, held=self._reply(w))
        self.applied: dict[int, list[int]] = {}  # clock -> workers whose push was applied
        self.dead_pending: list[int] = []  # killed, not evicted yet
        self.next_id = n

    def _reply(self, w: int) -> tuple[int, tuple[DataView, ...]]:
        at = self.state.table.as_dict().get(w, self.state.table.c_global)
        return data_views.from_wire(self.state.views.to_wire(max(0, at - 1)))

    def enabled(self) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        for w, s in self.workers.items():
            if not s.alive:
                if s.inflight:
                    out.append(("deliver", w))  # a dead worker's push may still arrive
                continue
            if s.started == s.sent and s.acked >= s.started - 1:
                out.append(("start", w))
            if s.started > s.sent and s.acked >= s.sent:
                out.append(("send", w))
            if s.inflight:
                out.append(("deliver", w))
            if s.delivered:
                out.append(("ack", w))
        return out

    def do(self, kind: str, w: int) -> None:
        s = self.workers.get(w)
        if kind == "start" and s is not None:
            j = s.started + 1
            got = data_views.split_of(s.held[1], j, w)
            split = (self.first.index(w), len(self.first)) if got is None else got[:2]
            assert split[0] >= 0, (w, j, s.held)  # a live member is always in its view
            s.used[j], s.started = split, j
        elif kind == "send" and s is not None:
            s.sent += 1
            s.inflight.append(s.sent)
        elif kind == "deliver" and s is not None:
            c = s.inflight.pop(0)
            try:
                new = clock_rules.push(self.state, w, c)
            except Refused:
                return  # evicted already: not applied
            assert new is not None
            self.state = new
            self.applied.setdefault(c, []).append(w)
            s.delivered.append(c)
        elif kind == "ack" and s is not None:
            s.acked = s.delivered.pop(0)
            s.held = data_views.absorb(s.held, self._reply(w))
        elif kind == "kill" and s is not None and s.alive:
            s.alive = False
            self.dead_pending.append(w)
        elif kind == "evict" and self.dead_pending:
            victim = self.dead_pending.pop(0)
            self.state, _ = clock_rules.evict(self.state, victim)
        elif kind == "leave" and s is not None and s.alive and not s.inflight and not s.delivered:
            if s.started == s.sent:  # (the client leaves between clocks, every push acknowledged)
                s.alive = False
                self.state = clock_rules.leave(self.state, w)
        elif kind == "burst" and s is not None and s.alive:  # one worker runs clocks ahead
            for _ in range(4):
                for step in ("start", "send", "deliver", "ack"):
                    if (step, w) in self.enabled():
                        self.do(step, w)
        elif kind == "join":
            wid = self.next_id
            self.next_id += 1
            self.state, at = clock_rules.hello(self.state, wid, 0, resync=False)
            self.workers[wid] = Sim(wid, at, held=self._reply(wid))

    def check(self) -> int:
        """The account of every clock all live workers pushed; returns how many clocks."""
        for w in list(self.dead_pending):
            self.state, _ = clock_rules.evict(self.state, w)
        views, first = self.state.views, self.first
        end = self.state.table.c_global if self.state.table.entries else 0
        for c in range(end):
            v = views.at(c)
            members = first if v is None else v.members
            slots: dict[int, str] = {}
            for w in self.applied.get(c, []):
                assert self.workers[w].used[c] == (members.index(w), len(members)), (c, w)
                slots[members.index(w)] = f"push {w}"
            for d in views.dropped:
                if d.first <= c < d.stop:
                    assert d.worker_id in members and members.index(d.worker_id) not in slots, (c, d, slots)
                    slots[members.index(d.worker_id)] = f"dropped {d.worker_id}"
            assert sorted(slots) == list(range(len(members))), (c, members, slots, views)
        return end


events = st.lists(
    st.tuples(
        st.sampled_from(["step"] * 12 + ["kill", "evict", "leave", "join", "burst", "burst"]),
        st.integers(0, 1000),
    ),
    max_size=220,
)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 4), script=events)
def test_every_clock_is_split_once_and_every_slot_is_pushed_or_dropped(n: int, script: list) -> None:
    world = World(n)
    for kind, pick in script:
        if kind == "step":
            options = world.enabled()
            if options:
                world.do(*options[pick % len(options)])
            continue
        live = [w for w, s in world.workers.items() if s.alive]
        if kind in ("kill", "leave") and len(live) <= 1:
            continue
        target = live[pick % len(live)] if live else -1
        world.do(kind, target)
    # drain: the live workers train on until each has pushed past every clock applied so far,
    # so that every clock a dead or departed worker pushed is checked
    target = max((c for c in world.applied), default=-1) + 1
    for _ in range(20_000):
        live = [s for s in world.workers.values() if s.alive]
        options = world.enabled()
        if not options or all(s.acked >= target and s.started == s.sent for s in live):
            break
        world.do(*min(options, key=lambda o: world.workers[o[1]].acked))  # the one furthest behind
    end = world.check()
    assert not any(s.alive for s in world.workers.values()) or end >= target
    for a, b in zip(world.state.views.views, world.state.views.views[1:]):
        assert a.start < b.start and a.members != b.members


def test_a_worker_that_dies_ahead_of_the_others_keeps_its_applied_clocks_in_its_view() -> None:
    """Worker 0 runs 6 clocks ahead and dies: the new view starts at its clock 6, not at the
    survivor's 0 + 2 (its clocks 2-5 were applied with the old split)."""
    world = World(2)
    world.do("burst", 0)
    world.do("burst", 0)
    assert world.state.table.as_dict() == {0: 8, 1: 0}
    world.do("kill", 0)
    world.do("evict", 0)
    assert world.state.views.views[-1] == DataView(8, (1,)) and world.state.views.dropped == ()
    for _ in range(60):
        world.do(*min(world.enabled(), key=lambda o: o[1]))
    assert world.check() >= 8


def test_a_change_starts_two_clocks_past_the_table_and_replaces_an_unused_entry() -> None:
    views = data_views.first_view(DataViews(), [2, 0, 1], 0)
    assert views.views == (DataView(0, (0, 1, 2)),) and views.rev == 1
    views = data_views.change(views, [0, 1], top=5)
    assert views.views[-1] == DataView(7, (0, 1))
    views = data_views.change(views, [0], top=4)  # the leader died: not before the last start
    assert views.views[-1] == DataView(7, (0,)) and len(views.views) == 2 and views.rev == 3
    views = data_views.change(views, [0, 1, 2], top=5)  # back to the entry before: undone
    assert views.views == (DataView(0, (0, 1, 2)),)
    views = data_views.drop(views, 2, 3, 9, "evicted")
    assert views.dropped == (Dropped(2, 3, 9, "evicted"),)
    assert data_views.split_of(views.views, 8, 1) == (1, 3, 0)
    assert data_views.split_of((DataView(4, (1, 3)),), 2, 1) is None
    assert data_views.split_of((DataView(4, (1, 3)),), 9, 2) == (-1, 2, 4)


def test_drop_only_counts_the_clocks_whose_view_holds_the_worker() -> None:
    views = DataViews(views=(DataView(0, (0, 1)), DataView(5, (0, 1, 2)), DataView(9, (0, 1))), rev=3)
    got = data_views.drop(views, 2, 3, 11, "evicted")  # not a member before 5 nor from 9
    assert got.dropped == (Dropped(2, 5, 9, "evicted"),)


def test_a_worker_keeps_the_newest_table_and_malformed_ones_are_refused() -> None:
    held = (2, (DataView(0, (0, 1)), DataView(4, (0,))))
    assert data_views.absorb(held, (1, (DataView(4, (1,)),))) == held  # older: ignored
    got = data_views.absorb(held, (3, (DataView(4, (0, 2)), DataView(8, (2,)))))
    assert got == (3, (DataView(0, (0, 1)), DataView(4, (0, 2)), DataView(8, (2,))))
    wire = {"rev": 3, "views": [[0, [0, 1]], [4, [0, 2]]]}
    assert data_views.from_wire(wire) == (3, (DataView(0, (0, 1)), DataView(4, (0, 2))))
    for bad in (
        None,
        {"rev": "1", "views": []},
        {"rev": 1, "views": [[0, [1, 0]]]},  # unsorted
        {"rev": 1, "views": [[4, [0]], [4, [1]]]},  # starts not increasing
        {"rev": 1, "views": [[0, [-1]]]},
        {"rev": -1, "views": []},
        {"rev": 1, "views": [[0, [0]]] * 5000},
    ):
        with pytest.raises(ValueError):
            data_views.from_wire(bad)


def test_shard_zero_puts_a_joiner_in_a_new_view_and_drops_a_dead_workers_slices() -> None:
    state = ShardClocks(num_workers=2, keeps_views=True)
    for w in (0, 1):
        state, _ = clock_rules.hello(state, w, 0, resync=False)
    assert state.views.views == (DataView(0, (0, 1)),)  # the first view, once both joined
    for c in range(4):
        state = clock_rules.push(state, 0, c) or state
    state = clock_rules.push(state, 1, 0) or state  # worker 0 at 4, worker 1 at 1
    state, at = clock_rules.hello(state, 5, 0, resync=False)
    assert at == 6 and state.views.views[-1] == DataView(6, (0, 1, 5))
    state, _ = clock_rules.evict(state, 1)  # at clock 1: its slices of 1..top+2 are nobody's
    assert state.views.views[-1] == DataView(8, (0, 5))
    assert state.views.dropped == (Dropped(1, 1, 8, "evicted"),)
    other = ShardClocks(num_workers=2)  # another shard keeps no views
    other, _ = clock_rules.hello(other, 0, 0, resync=False)
    other, _ = clock_rules.hello(other, 1, 0, resync=False)
    assert clock_rules.leave(other, 1).views == DataViews()


def test_a_worker_that_finished_its_clocks_leaves_without_dropping_data() -> None:
    state = ShardClocks(num_workers=2, keeps_views=True)
    for w in (0, 1):
        state, _ = clock_rules.hello(state, w, 0, resync=False)
    for c in range(5):
        state = clock_rules.push(state, 0, c) or state
    done = clock_rules.leave(state, 0, finished=True)  # after the job's last clock: nothing to drop
    assert done.views == state.views and done.table.as_dict() == {1: 0}
    early = clock_rules.leave(state, 0)  # mid-run (SIGTERM): its next clocks' slices are dropped
    # (worker 1 is at clock 0: it may compute clock 1, so the new view starts at 5, not 2: the
    # leaver's clocks 2-4 were applied with the old view; nothing of it is dropped)
    assert early.views.dropped == () and early.views.views[-1] == DataView(5, (1,))


def test_a_joiner_after_a_leader_died_far_ahead_is_accepted_on_every_shard() -> None:
    """Worker 0 dies 18 clocks ahead of worker 1 (ASP): shard 0's next view starts at its clock
    20, so a joiner lands there; another shard, whose live table tops at 2, still accepts it (the
    join bound counts the clocks departed workers left at)."""
    shards = [ShardClocks(num_workers=2, keeps_views=True), ShardClocks(num_workers=2)]
    for i, state in enumerate(shards):
        for w in (0, 1):
            state, _ = clock_rules.hello(state, w, 0, resync=False)
        for c in range(20):
            state = clock_rules.push(state, 0, c) or state
        for c in range(2):
            state = clock_rules.push(state, 1, c) or state
        shards[i], _ = clock_rules.evict(state, 0)
    assert shards[0].views.views[-1] == DataView(20, (1,)) and shards[0].views.dropped == ()
    shards[0], at = clock_rules.hello(shards[0], 7, 0, resync=False)
    assert at == 20 and shards[0].views.views[-1] == DataView(20, (1, 7))
    shards[1], first = clock_rules.hello(shards[1], 7, 0, resync=False)  # (first round: c_global)
    shards[1], moved = clock_rules.hello(shards[1], 7, at, resync=False)  # the client's second round
    assert (first, moved) == (2, 20) and shards[1].high == 20
    with pytest.raises(Refused):  # still bounded: JOIN_LEAD past the highest clock ever seen
        clock_rules.hello(shards[1], 8, 20 + clock_rules.JOIN_LEAD + 1, resync=False)
