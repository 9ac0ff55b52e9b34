"""The pure PS pieces: clock rules (property tests against a naive reference), PSConfig validation,
the shared event core and the config validators."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flotilla.core.checks import require_choice, require_int, require_number
from flotilla.core.errors import ConfigError
from flotilla.core.events import EventQueue, run_until
from flotilla.ps import clock_rules
from flotilla.ps.clock_rules import Refused, ShardClocks
from flotilla.ps.config import ClientOptions, DeltaUpdate, PSConfig, ServerSGD, ShardConfig, shard_config_from
from flotilla.ps.consistency import ASP, BSP, SSP, WSP, reference_may_serve_pull

pytestmark = pytest.mark.timeout(30)

# ----------------------------------------------------------------------------- clock rules

Op = tuple[str, int, int]  # (kind, worker, clock)
ops = st.lists(
    st.tuples(
        st.sampled_from(["hello", "resync", "push", "leave", "pull", "evict", "bar"]),
        st.integers(0, 3),
        st.integers(-1, 6),
    ),
    max_size=25,
)
models = st.sampled_from([BSP(), ASP(), SSP(staleness=1), SSP(staleness=2), WSP(s_local=1, clock_distance=1)])


class Naive:
    """The rules as the module doc states them, over plain dicts."""

    def __init__(self, num_workers: int) -> None:
        self.n, self.clocks, self.joined, self.departed, self.floor = num_workers, {}, set(), set(), 0
        self.fresh: set[int] = set()  # joined mid-run, not pushed yet
        self.high = 0  # the highest clock a departed worker left at

    def step(self, kind: str, w: int, c: int, model) -> object:
        if kind in ("hello", "resync"):
            if c < 0 or w in self.departed:
                return "refused"
            if w in self.clocks and w in self.fresh and c > self.clocks[w]:
                others = [v for x, v in self.clocks.items() if x != w]
                if c > max(max(others, default=self.c_global()), self.high) + clock_rules.JOIN_LEAD:
                    return "refused"
                self.clocks[w] = max(c, min(others, default=self.clocks[w]))
                return self.clocks[w]
            if w in self.clocks:
                if kind == "resync" and c > self.clocks[w]:
                    self.clocks[w] = c
                return self.clocks[w]
            if len(self.joined) >= self.n:  # join mid-run: at max(c, c_global), never ahead of all
                top = max(max(self.clocks.values(), default=self.c_global()), self.high)
                if c > top + clock_rules.JOIN_LEAD:
                    return "refused"
                self.clocks[w] = max(c, self.c_global())
                self.joined.add(w)
                self.fresh.add(w)
                return self.clocks[w]
            self.floor = min(self.floor, c) if self.joined else c
            self.clocks[w] = c
            self.joined.add(w)
            return c
        if kind == "bar":  # (an id that never said hello: refused from now on)
            if w in self.clocks or w in self.departed:
                return False
            self.departed.add(w)
            return True
        if kind == "evict":
            if c < 0 or w not in self.clocks:
                return False
            self.floor = self.c_global()
            self.high = max(self.high, self.clocks[w])
            del self.clocks[w]
            self.departed.add(w)
            self.fresh.discard(w)
            return True
        if w not in self.clocks:
            return "refused"
        if kind == "leave":
            self.floor = self.c_global()
            self.high = max(self.high, self.clocks[w])
            del self.clocks[w]
            self.departed.add(w)
            self.fresh.discard(w)
            return None
        if kind == "push":
            if c == self.clocks[w] - 1:
                return "retry"
            if c != self.clocks[w]:
                return "refused"
            self.clocks[w] += 1
            self.fresh.discard(w)
            return c + 1
        ahead = 1 if isinstance(model, ASP) or (isinstance(model, SSP) and model.staleness >= 1) else 0
        if not 0 <= c <= self.clocks[w] + ahead:
            return "refused"
        if isinstance(model, ASP):
            return True
        pushes = {(v, k) for v, n in self.clocks.items() for k in range(n)}
        return len(self.joined) >= self.n and reference_may_serve_pull(model, pushes, list(self.clocks), c)

    def c_global(self) -> int:
        return min(self.clocks.values(), default=self.floor)


def _apply(state: ShardClocks, kind: str, w: int, c: int, model) -> tuple[ShardClocks, object]:
    try:
        if kind in ("hello", "resync"):
            state, recorded = clock_rules.hello(state, w, c, resync=kind == "resync")
            return state, recorded
        if kind == "leave":
            return clock_rules.leave(state, w), None
        if kind == "evict":
            return clock_rules.evict(state, w) if c >= 0 else (state, False)
        if kind == "bar":
            return clock_rules.bar(state, w)
        if kind == "push":
            new = clock_rules.push(state, w, c)
            return (state, "retry") if new is None else (new, new.clock_of(w))
        return state, clock_rules.check_pull(state, model, w, c)
    except Refused:
        return state, "refused"


@settings(max_examples=60, deadline=None)
@given(ops=ops, model=models, num_workers=st.integers(1, 3))
@example(  # a fresh joiner moving up lands at the others' c_global, not its own (found by CI)
    ops=[("hello", 0, 0), ("hello", 1, 2), ("hello", 3, 0), ("leave", 0, 0), ("hello", 3, 1)],
    model=BSP(),
    num_workers=1,
)
def test_clock_rules_match_the_naive_reference(ops: list[Op], model, num_workers: int) -> None:
    state, naive = ShardClocks(num_workers=num_workers), Naive(num_workers)
    for kind, w, c in ops:
        before = state
        state, got = _apply(state, kind, w, c, model)
        assert got == naive.step(kind, w, c, model), (kind, w, c)
        if got is False or got in ("refused", "retry"):
            assert state == before  # a refused request changes nothing
        assert state.table.as_dict() == naive.clocks
        assert state.table.c_global == naive.c_global()
        assert state.complete == (len(naive.joined) >= num_workers)


@settings(max_examples=30, deadline=None)
@given(ops=ops, num_workers=st.integers(1, 3))
def test_c_global_never_falls_once_the_job_is_complete(ops: list[Op], num_workers: int) -> None:
    state = ShardClocks(num_workers=num_workers)
    low = None
    for kind, w, c in ops:
        state, _ = _apply(state, kind, w, c, BSP())
        if state.complete:
            assert low is None or state.table.c_global >= low
            low = state.table.c_global


def test_clock_rule_codes_and_blocked_reason() -> None:
    state, _ = clock_rules.hello(ShardClocks(num_workers=2), 0, 0, resync=False)
    with pytest.raises(Refused) as info:
        clock_rules.check_pull(state, BSP(), 0, 1)
    assert info.value.code == "bad_clock"
    assert clock_rules.check_pull(state, ASP(), 0, 1) is True  # read-ahead, never waits
    assert clock_rules.check_pull(state, BSP(), 0, 0) is False  # worker 1 has not joined
    state, _ = clock_rules.hello(state, 1, 0, resync=False)
    state = clock_rules.push(state, 0, 0)
    assert state is not None and clock_rules.push(state, 0, 0) is None  # a retry
    with pytest.raises(Refused) as info:
        clock_rules.push(state, 0, 5)
    assert info.value.code == "bad_clock"
    with pytest.raises(Refused) as info:  # a join mid-run more than JOIN_LEAD ahead of all
        clock_rules.hello(state, 2, 5, resync=False)
    assert info.value.code == "bad_clock"
    joined, at = clock_rules.hello(state, 2, 0, resync=False)  # joins mid-run at c_global
    assert at == 0 and joined.table.as_dict() == {0: 1, 1: 0, 2: 0}
    assert clock_rules.blocked_reason(state, BSP(), 1).startswith(
        "c_global=0 must reach 1; workers behind: [1]"
    )
    state = clock_rules.leave(state, 1)
    with pytest.raises(Refused, match="has left"):
        clock_rules.hello(state, 1, 0, resync=True)
    barred, did = clock_rules.bar(state, 7)  # (a newcomer given up, its hello still on its way)
    assert did and 7 in barred.departed and barred.table == state.table
    with pytest.raises(Refused, match="has left"):
        clock_rules.hello(barred, 7, 0, resync=False)
    assert clock_rules.bar(barred, 0) == (barred, False)  # (a live worker: evict it instead)
    with pytest.raises(Refused, match="worker id"):
        clock_rules.bar(barred, -1)


# ----------------------------------------------------------------------------- PSConfig


def test_ps_config_validates_and_derives() -> None:
    ps = PSConfig(consistency=SSP(staleness=2), update=ServerSGD(lr=0.1, momentum=0.5), read_mode="cached")
    assert ps.cached_reads and not ps.read_ahead and ps.wave_size == 1
    assert PSConfig(consistency=BSP(), update=DeltaUpdate(), read_mode="read_ahead").read_ahead is False
    assert PSConfig(consistency=WSP(s_local=3, clock_distance=0), update=DeltaUpdate()).wave_size == 4
    shard = shard_config_from(ps, num_workers=3, shard_index=1)
    assert shard == ShardConfig(
        shard_index=1, num_shards=2, num_workers=3, consistency=SSP(staleness=2), update=ps.update
    )
    assert ClientOptions.of(PSConfig(update=DeltaUpdate(), pull_timeout_s=2.0)).attempt_timeout_s == 2.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"read_mode": "sometimes"}, "PSConfig.read_mode must be one of 'plain', 'cached', 'read_ahead'"),
        ({"num_servers": 0}, "PSConfig.num_servers must be an int >= 1, got 0"),
        ({"num_servers": True}, "PSConfig.num_servers must be an int >= 1, got True"),
        ({"chunk_bytes": 1.5}, "PSConfig.chunk_bytes"),
        ({"pull_timeout_s": float("nan")}, "PSConfig.pull_timeout_s must be a finite number > 0"),
        ({"snapshot_every_s": -1}, "PSConfig.snapshot_every_s must be a finite number >= 0"),
        ({"consistency": "ssp"}, "PSConfig.consistency must be BSP or ASP or SSP or WSP"),
        ({"update": "delta"}, "PSConfig.update must be ServerSGD or DeltaUpdate"),
        (
            {"consistency": WSP(s_local=1, clock_distance=0), "update": ServerSGD(lr=0.1)},
            "must be DeltaUpdate",
        ),
    ],
)
def test_ps_config_errors_name_the_field_and_allowed(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        PSConfig(**{"update": DeltaUpdate(), **kwargs})
    assert field in str(info.value)


def test_checks_helpers() -> None:
    assert require_int("A", "n", 3, min=1, max=3) == 3
    with pytest.raises(ConfigError, match=r"^A.n must be an int >= 1 and <= 3, got 4$"):
        require_int("A", "n", 4, min=1, max=3)
    with pytest.raises(ConfigError, match=r"^A.x must be a finite number > 0, got inf$"):
        require_number("A", "x", float("inf"), gt=0.0)
    with pytest.raises(ConfigError, match="^A.x must be a finite number >= 0, got False$"):
        require_number("A", "x", False, min=0.0)
    assert require_choice("A", "k", "b", ("a", "b")) == "b"
    with pytest.raises(ConfigError, match="^A.k must be one of 'a', 'b', got 'c'$"):
        require_choice("A", "k", "c", ("a", "b"))


# ----------------------------------------------------------------------------- event core


def test_event_queue_orders_by_time_priority_tie_then_insertion() -> None:
    q: EventQueue[str] = EventQueue()
    q.push(2.0, "late")
    q.push(1.0, "b-start", priority=1)
    q.push(1.0, "a-done", priority=0, tie=0.9)
    q.push(1.0, "c-done", priority=0, tie=0.1)
    q.push(1.0, "d-done", priority=0, tie=0.1)  # same keys: first in, first out
    assert [e.payload for e in q.pop_simultaneous()] == ["c-done", "d-done", "a-done", "b-start"]
    assert q.now == 1.0 and len(q) == 1
    with pytest.raises(ValueError, match="before the current time"):
        q.push(0.5, "past")
    assert [e.payload for e in q.drain()] == ["late"] and not q


def test_run_until_stops_at_the_limit_or_the_predicate() -> None:
    q: EventQueue[int] = EventQueue()
    seen: list[int] = []

    def handle(event) -> None:
        seen.append(event.payload)
        if event.payload < 5:
            q.push(event.time + 1, event.payload + 1)

    q.push(0, 0)
    assert run_until(q, handle, until=2.5) == 2 and seen == [0, 1, 2]
    assert run_until(q, handle, stop=lambda: seen[-1] == 4) == 4 and seen == [0, 1, 2, 3, 4]
    assert run_until(q, handle) == 5 and not q


# ----------------------------------------------------------------------------- churn over shards

churn = st.lists(
    st.tuples(
        st.sampled_from(["push", "pull", "die", "join"]),
        st.integers(0, 5),  # worker
        st.integers(0, 2),  # shard (push: pushes land on shards one at a time; die: evict there)
    ),
    max_size=60,
)


@settings(max_examples=80, deadline=None)
@given(
    ops=churn,
    model=st.sampled_from([BSP(), SSP(staleness=1), SSP(staleness=3), WSP(s_local=0, clock_distance=2)]),
)
def test_churn_no_gate_waits_on_the_dead_and_every_served_read_keeps_its_bound(ops: list, model) -> None:
    """Random interleavings of per-shard pushes, pulls, deaths (evicted shard by shard) and joins
    over 3 shards of a 3-worker job: c_global never moves back; no pull is held back by a worker
    known dead on that shard; every pull served for clock c has every live worker at >= c - lag
    (I4); a dead worker never counts again; a joiner lands at c_global, not ahead of the others."""
    lag = {BSP: 0}.get(type(model), getattr(model, "staleness", getattr(model, "clock_distance", 0)))
    shards = [ShardClocks(num_workers=3) for _ in range(3)]
    for s in range(3):
        for w in range(3):
            shards[s], _ = clock_rules.hello(shards[s], w, 0, resync=False)
    dead: set[int] = set()
    for kind, w, s in ops:
        before = [st_.table.c_global for st_ in shards]
        if kind == "push" and w not in dead and w in shards[s].table.as_dict():
            c = shards[s].clock_of(w)
            if all(c <= x.clock_of(w) for x in shards if w in x.table.as_dict()):  # clock order
                shards[s] = clock_rules.push(shards[s], w, c) or shards[s]
        elif kind == "die":
            dead.add(w)
            shards[s], _ = clock_rules.evict(shards[s], w)
        elif kind == "join" and w not in dead and all(w not in x.joined for x in shards):
            got = [clock_rules.hello(shards[i], w, 0, resync=False) for i in range(3)]
            shards = [g[0] for g in got]
            for i, (state, at) in enumerate(got):
                assert at == before[i] == state.table.c_global  # at the global clock, which stays
        elif kind == "pull" and w in shards[s].table.as_dict():
            own = shards[s].clock_of(w)
            served = clock_rules.check_pull(shards[s], model, w, own)
            live = {v: c for v, c in shards[s].table.entries}
            assert served == all(c >= own - lag for c in live.values())  # only the live can block
            if served:  # I4 for the read served
                assert all(c >= own - lag for v, c in live.items() if v not in shards[s].departed)
            assert not set(live) & shards[s].departed
        for i, x in enumerate(shards):
            assert x.table.c_global >= before[i]  # never moves back (leaves, deaths, joins)
            assert not (x.departed & set(x.table.as_dict()))  # a dead worker never counts again
