"""``CoordinatedMembership.catch_up``: what a worker running a strategy without a barrier and with
fixed membership (partial_reduce) sends between two units, and what it makes of the answers --
one ``poll_view`` at most, never a wait (a fake link stands in for the coordinator)."""

from __future__ import annotations

from typing import Any

from flotilla.cluster.membership import View
from flotilla.comm.store import StoreAddress
from flotilla.core.errors import CommError
from flotilla.roles.coordinated import CoordinatedMembership

V1 = View(epoch=1, members=(0, 1, 2))
V2 = View(epoch=2, members=(0, 1), left=(2,))


class FakeLink:
    def __init__(self, replies: list[Any]) -> None:
        self.replies = replies
        self.calls: list[tuple[str, dict]] = []
        self.broken_epoch = 0
        self.latest_epoch = 1
        self.coordinator_gone = False
        self.orphaned = False
        self.on_broken: Any = None
        self.on_gone: Any = None

    def call(self, op: str, body: dict | None = None, timeout_s: float = 10.0) -> dict:
        self.calls.append((op, dict(body or {})))
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


def _member(link: FakeLink, worker_id: int = 0) -> CoordinatedMembership:
    m = CoordinatedMembership(
        link,  # type: ignore[arg-type]
        worker_id,
        StoreAddress("127.0.0.1", 1),
        timeout_s=1.0,
        backend="gloo",
        device=None,
        view_wait_s=1.0,
    )
    m.view = V1
    return m


def test_nothing_broken_nothing_newer_sends_nothing() -> None:
    link = FakeLink([])
    assert _member(link).catch_up() == V1 and link.calls == []


def test_a_broken_epoch_is_reported_and_the_worker_trains_on_until_the_view_forms() -> None:
    link = FakeLink([{"status": "wait"}, CommError("slow"), {"status": "view", "view": V2.to_dict()}])
    link.broken_epoch, link.latest_epoch = 1, 2
    m = _member(link)
    assert m.catch_up() == V1  # reported; no view yet: trains on in the old one
    assert m.catch_up() == V1  # (the coordinator did not answer: again at the next boundary)
    assert m.catch_up() == V2 and m.view == V2
    body = {"worker_id": 0, "after_epoch": 1, "adopt": True}
    assert link.calls == [("poll_view", body)] * 3
    assert m.catch_up() == V2 and len(link.calls) == 3  # epoch 1 broken, not 2: nothing more


def test_a_newer_view_is_asked_for_without_a_failure_report_at_most_every_interval() -> None:
    link = FakeLink([{"status": "wait"}])
    link.latest_epoch = 2  # (a worker exited: a newer view, nothing broken)
    m = _member(link)
    assert m.catch_up() == V1 and m.catch_up() == V1
    assert link.calls == [("poll_view", {"worker_id": 0, "after_epoch": 1, "adopt": False})]


def test_removed_or_left_out_means_out_of_the_job() -> None:
    link = FakeLink([{"status": "removed"}])
    link.broken_epoch = 1
    m = _member(link)
    assert m.catch_up() is None and "removed" in m.evicted
    link = FakeLink([{"status": "view", "view": V2.to_dict()}])
    link.broken_epoch = 1
    m = _member(link, worker_id=2)
    assert m.catch_up() is None and "without it" in m.evicted
