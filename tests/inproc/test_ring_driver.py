"""The ring repair runtime (``roles/ring_driver.py``) over in-process message-plane servers: real
drivers, real authenticated messages, no coordinator.

- a member that dies is repaired away: every survivor adopts the same next view, whichever
  neighbour accuses it, and a second death is repaired from that view;
- forged, unauthenticated, replayed, malformed and impersonating messages are refused (an error
  reply), logged, and change no view;
- the split-brain rule: a view holding no strict majority of the previous one is never run;
- a member that was frozen while the others repaired it away learns, when it wakes up and
  probes, that it is out (instead of waiting for a view that will never come).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from flotilla.cluster.membership import View
from flotilla.cluster.ring_repair_messages import RECONCILE, Ballot, Message
from flotilla.comm.codec import Limits
from flotilla.comm.endpoint_client import ClientCore
from flotilla.comm.msgplane import serve
from flotilla.core.errors import RemoteError
from flotilla.roles.ring_driver import RingDriver, sender_name

SECRET = b"s" * 32
_names = itertools.count()


class Freezable(RingDriver):
    """A driver whose process can be 'frozen': it then answers no message."""

    frozen = False

    def _on_request(self, req: Any) -> dict[str, Any]:
        if self.frozen:
            raise RemoteError("unavailable", "frozen")
        return super()._on_request(req)


class Ring:
    def __init__(self, n: int) -> None:
        tag = next(_names)
        self.addresses = {i: f"mem://ring-test-{tag}-{i}" for i in range(n)}
        self.servers = {i: serve(SECRET, a, name=f"peer-{i}") for i, a in self.addresses.items()}
        self.drivers = {i: Freezable(i, SECRET, retry_s=0.02, send_timeout_s=0.2) for i in range(n)}
        self.view = View(epoch=1, members=tuple(range(n)))
        for i, d in self.drivers.items():
            d.register(self.servers[i])
            self.servers[i].start()
            d.enter(self.view, self.addresses)

    def kill(self, i: int) -> None:
        self.drivers.pop(i).close()
        self.servers.pop(i).close()

    def close(self) -> None:
        for i in list(self.drivers):
            self.kill(i)


@pytest.fixture
def ring4() -> Iterator[Ring]:
    ring = Ring(4)
    try:
        yield ring
    finally:
        ring.close()


def never() -> bool:
    return False


def test_a_dead_member_is_repaired_away_and_then_another(ring4: Ring) -> None:
    ring4.kill(3)
    ring4.drivers[2].suspect(frozenset({3}))  # its neighbours accuse it (both, here)
    ring4.drivers[0].suspect(frozenset({3}))
    views = {i: d.wait_adopted(1, 10.0, never) for i, d in ring4.drivers.items()}
    assert all(v is not None and v.members == (0, 1, 2) and v.epoch == 2 for v in views.values()), views
    assert all(v is not None and v.left == (3,) for v in views.values())
    ring4.kill(1)
    ring4.drivers[0].suspect(frozenset({1}))
    again = {i: d.wait_adopted(2, 10.0, never) for i, d in ring4.drivers.items()}
    assert all(v is not None and v.members == (0, 2) and v.epoch == 3 for v in again.values()), again


def _frames(sender: str, message: dict, secret: bytes = SECRET) -> list:
    return ClientCore(secret, sender=sender, limits=Limits()).request("ring", {"message": message}, [])[1]


def _refused(ring: Ring, to: int, frames: list) -> bool:
    reply = ring.servers[to]._core.handle(frames, peer="test")
    outcome = ClientCore(SECRET, sender="test", limits=Limits()).reply(reply)
    return outcome.error is not None


def test_forged_replayed_and_malformed_messages_change_nothing(ring4: Ring) -> None:
    good = Message(kind=RECONCILE, sender=1, epoch=1, ballot=Ballot(1, 1, 0), members=(0, 1, 2)).to_dict()
    outsider = Message(kind=RECONCILE, sender=1, epoch=1, ballot=Ballot(1, 1, 0), members=(0, 1, 9)).to_dict()
    assert _refused(ring4, 2, _frames(sender_name(1), good, secret=b"x" * 32))  # not signed with the secret
    assert _refused(ring4, 2, _frames(sender_name(3), good))  # worker 3 speaking as worker 1
    assert _refused(ring4, 2, _frames(sender_name(1), {**good, "kind": "TAKEOVER"}))  # malformed
    assert _refused(ring4, 2, _frames(sender_name(1), {**good, "members": "all"}))
    before = ring4.drivers[2]._state
    ring4.servers[2]._core.handle(_frames(sender_name(1), outsider), peer="test")  # names a stranger: refused
    assert ring4.drivers[2]._state == before
    # the driver's own refusals are counted per reason and sender (and rate-limited in the log)
    counted = ring4.drivers[2]._rejections.counts()
    assert counted["impersonation"] == {sender_name(3): 1}, counted
    assert sum(counted["malformed"].values()) == 2 and sum(counted["refused"].values()) == 1, counted
    frames = _frames(sender_name(1), good)
    assert not _refused(ring4, 2, frames)  # (authentic: accepted once, as any message)
    assert _refused(ring4, 2, frames)  # the same frames again: a replay
    for d in ring4.drivers.values():  # nobody adopts anything: nobody is dead
        assert d.wait_adopted(1, 0.3, never) is None and not d.out


def test_a_minority_view_is_never_run(ring4: Ring) -> None:
    ring4.kill(3)
    ring4.kill(2)
    ring4.drivers[0].suspect(frozenset({3}))
    ring4.drivers[1].suspect(frozenset({2}))
    for d in ring4.drivers.values():
        assert d.wait_adopted(1, 10.0, never) is None  # (it returns once this side is out)
        assert "split-brain rule" in d.out


def test_a_frozen_member_that_wakes_up_learns_it_is_out(ring4: Ring) -> None:
    frozen = ring4.drivers[3]
    assert isinstance(frozen, Freezable)
    frozen.frozen = True
    ring4.drivers[2].suspect(frozenset({3}))
    ring4.drivers[0].suspect(frozenset({3}))
    for i in (0, 1, 2):
        view = ring4.drivers[i].wait_adopted(1, 10.0, never)
        assert view is not None and view.members == (0, 1, 2)
    frozen.frozen = False  # it wakes up: its group is gone, it waits -- and probes
    assert frozen.wait_adopted(1, 10.0, never) is None
    assert "chosen without us" in frozen.out
