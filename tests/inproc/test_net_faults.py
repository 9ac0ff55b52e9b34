"""Message faults below authentication (``comm/faulty.py``, issue 37 item 4, first part): a lost
request times out and changes nothing, a duplicated one is applied once, a delayed one arrives
late, a reordered one is overtaken and refused by the replay guard (a drop the protocol must
retry); the decisions are seeded per client; bad plans are refused naming the field.  On the
collective plane the network can only break a group's connections (``collective_reset``): the
group fails there, its members still alive."""

from __future__ import annotations

import time

import pytest

from flotilla.comm import auth, faulty
from flotilla.comm.faulty import FaultInjector, NetFaults
from flotilla.comm.msgplane import Request, connect, serve
from flotilla.core.errors import CallTimeout

SECRET = auth.generate_secret()


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def incr(self, req: Request) -> dict:
        self.count += int(req.body["by"])
        return {"count": self.count}


@pytest.fixture
def server():
    counter = Counter()
    srv = serve(SECRET, "mem://", name="faulty")
    srv.register("incr", counter.incr, None)
    srv.register("ping", lambda req: {"pong": True}, None)
    srv.start()
    try:
        yield counter, srv
    finally:
        faulty.install(None)
        srv.close()


def _replays(srv) -> int:
    """The requests the server refused as replays (from every sender)."""
    return sum(srv._core.rejections.counts().get("replay", {}).values())


def _client(srv, faults: NetFaults, name: str = "c"):
    faulty.install(faults)
    try:
        return connect(srv.address, SECRET, sender=name)
    finally:
        faulty.install(None)  # (clients made afterwards, e.g. by other tests, are clean)


def test_a_lost_request_times_out_and_changes_nothing(server) -> None:
    counter, srv = server
    with _client(srv, NetFaults(drop=1.0, ops=("incr",))) as c:
        with pytest.raises(CallTimeout):
            c.call("incr", {"by": 5}, timeout_s=0.3)
        assert c.call("ping", {}).body == {"pong": True}  # other ops untouched
        assert c._faults is not None and c._faults.counts["drop"] == 1
    assert counter.count == 0


def test_a_duplicated_request_is_applied_once(server) -> None:
    counter, srv = server
    with _client(srv, NetFaults(duplicate=1.0)) as c:
        assert c.call("incr", {"by": 2}).body == {"count": 2}
        assert c.call("incr", {"by": 3}).body == {"count": 5}
    assert counter.count == 5
    assert _replays(srv) >= 2  # the copies, refused


def test_a_lost_reply_times_out_after_the_request_was_applied(server) -> None:
    """Why a control request must be idempotent: its effect happened, the caller cannot know."""
    counter, srv = server
    with _client(srv, NetFaults(lose_reply=1.0, ops=("incr",))) as c:
        with pytest.raises(CallTimeout):
            c.call("incr", {"by": 2}, timeout_s=0.5)
        assert counter.count == 2  # applied all the same
        assert c.call("ping", {}).body == {"pong": True}  # (another op: not faulted)


def test_a_delayed_request_arrives_late(server) -> None:
    counter, srv = server
    with _client(srv, NetFaults(delay=1.0, delay_s=0.2)) as c:
        t0 = time.monotonic()
        assert c.call("incr", {"by": 1}).body == {"count": 1}
        assert time.monotonic() - t0 >= 0.2


def test_a_reordered_request_is_overtaken_and_refused_as_a_replay(server) -> None:
    counter, srv = server
    with _client(srv, NetFaults(reorder=1.0, ops=("incr",))) as c:
        with pytest.raises(CallTimeout):
            c.call("incr", {"by": 7}, timeout_s=0.3)  # held back
        assert c.call("ping", {}).body == {"pong": True}  # sent first; the held incr after it
        deadline = time.monotonic() + 5
        while _replays(srv) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert counter.count == 0 and _replays(srv) == 1


def test_decisions_are_seeded_per_client() -> None:
    plan = NetFaults(drop=0.3, duplicate=0.2, delay=0.1, reorder=0.1, delay_s=0.0, seed=4)

    def decisions(name: str) -> list[str]:
        inj, out = FaultInjector(plan, name), []
        for _ in range(200):
            before = dict(inj.counts)
            inj.send("op", lambda f: None, [b"x"])
            out.append(next(k for k, v in inj.counts.items() if v != before.get(k, 0)))
        return out

    a, b, other = decisions("w0"), decisions("w0"), decisions("w1")
    assert a == b and a != other
    share = a.count("drop") / len(a)
    assert 0.15 < share < 0.45  # ~0.3


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"drop": 1.5}, "NetFaults.drop"),
        ({"drop": 0.6, "duplicate": 0.6}, "must be <= 1"),
        ({"delay_s": -1.0}, "NetFaults.delay_s"),
        ({"reorder": "x"}, "NetFaults.reorder"),
        ({"lose_reply": 2.0}, "NetFaults.lose_reply"),
        ({"collective_reset": -0.1}, "NetFaults.collective_reset"),
    ],
)
def test_bad_plans_are_refused_naming_the_field(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        NetFaults(**kwargs)


def test_a_plan_travels_as_json_in_the_environment() -> None:
    plan = NetFaults(drop=0.1, ops=("heartbeat",), seed=3)
    assert NetFaults.from_json(plan.to_json()) == plan
    inj = faulty.injector_for("w0", env={faulty.ENV_VAR: plan.to_json()})
    assert inj is not None and inj.faults == plan
    assert faulty.injector_for("w0", env={}) is None


def test_a_collective_reset_is_drawn_per_group_and_seeded() -> None:
    env = {faulty.ENV_VAR: NetFaults(collective_reset=0.3, seed=2).to_json()}
    a, b = faulty.collective_reset_draw("epoch/1/0", env), faulty.collective_reset_draw("epoch/1/0", env)
    other = faulty.collective_reset_draw("epoch/1/1", env)
    assert a is not None and b is not None and other is not None
    da, db, do = [a() for _ in range(300)], [b() for _ in range(300)], [other() for _ in range(300)]
    assert da == db and da != do and 0.2 < sum(da) / 300 < 0.4
    assert faulty.collective_reset_draw("epoch/1/0", env={}) is None
    assert faulty.collective_reset_draw("x", {faulty.ENV_VAR: NetFaults(drop=0.1).to_json()}) is None


def test_a_group_whose_connections_the_network_resets_fails_with_its_members_alive() -> None:
    import threading

    import torch

    from flotilla.comm.collective import EpochGroup
    from flotilla.comm.store import StoreHost, connect_store
    from flotilla.core.errors import CollectiveError

    host = StoreHost()
    faulty.install(NetFaults(collective_reset=1.0))  # (every launch: both members reset theirs)
    errors: dict[int, str] = {}
    groups: dict[int, EpochGroup] = {}

    def member(rank: int) -> None:
        groups[rank] = g = EpochGroup(connect_store(host.address), epoch=1, rank=rank, world_size=2)
        try:
            g.allreduce(torch.ones(4))
        except CollectiveError as exc:
            errors[rank] = str(exc)

    try:
        threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(errors) == [0, 1]
        assert all("connection reset by the network as allreduce was launched" in e for e in errors.values())
        assert all(g.aborted for g in groups.values())  # (failed: released, peers see it)
        # (a one-member group sends nothing: no network to reset it)
        alone = EpochGroup(connect_store(host.address), epoch=2, rank=0, world_size=1)
        assert torch.equal(alone.allreduce(torch.ones(2)), torch.ones(2))
        alone.close()
    finally:
        faulty.install(None)
        for g in groups.values():
            g.close()
        host.close()
