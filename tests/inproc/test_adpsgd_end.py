"""AD-PSGD's end in process (``sync/adpsgd_end.py``): one collector averages the final replicas --
the job's rank 0, or, when it died first (even after its average, before the job's end), the
lowest finished worker whose replica lives; every other finished worker only waits."""

from __future__ import annotations

import threading
from typing import Any

import torch

from flotilla.sync.adpsgd_service import PeerDirectory

from ._adpsgd_cluster import joiner


class _Req:
    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body


def _never() -> bool:
    return False


def _avg(*flats: torch.Tensor) -> torch.Tensor:
    total = sum((f.double() for f in flats), torch.zeros_like(flats[0], dtype=torch.float64))
    return (total / len(flats)).float()


def test_the_next_finished_worker_takes_over_when_the_collector_died_after_averaging(cluster_of: Any) -> None:
    c = cluster_of(3)
    for w in (1, 2, 0):
        c.workers[w].mark_finished()
    finals = {w: c.workers[w]._flat().clone() for w in range(3)}
    assert c.workers[0].finalize(lambda: False) and c.directory.collected == (0, 1, 2)
    over = threading.Event()
    result: dict[str, bool] = {}
    waiter = threading.Thread(target=lambda: result.update(w2=c.workers[2].take_over(over.is_set, _never)))
    waiter.start()  # (worker 2 is not the collector while worker 1 lives: it only waits)
    c.servers[0].close()  # the collector dies before it reported the job's result
    c.directory.on_dead(0)
    assert c.directory.collected is None and c.directory.gone == {0}
    assert c.workers[1].take_over(_never, _never)
    assert torch.equal(c.workers[1]._flat(), _avg(finals[1], finals[2]))
    assert c.directory.collected == (1, 2) and c.directory.collector == 1
    over.set()  # (the job's end, which worker 1 reports)
    waiter.join(timeout=30)
    assert result == {"w2": False}
    assert torch.equal(c.workers[2]._flat(), finals[2])


def test_while_the_collector_lives_the_other_finished_workers_only_wait(cluster_of: Any) -> None:
    c = cluster_of(3)
    for w in (1, 2, 0):
        c.workers[w].mark_finished()
    assert c.workers[0].finalize(lambda: False)
    before = c.workers[1]._flat().clone()
    asked = iter(range(20))
    assert not c.workers[1].take_over(lambda: next(asked, None) is None, _never)  # (20 looks, then the end)
    assert torch.equal(c.workers[1]._flat(), before) and c.directory.collector == 0


def test_a_rank_0_above_a_live_finished_worker_leaves_the_average_to_it(cluster_of: Any) -> None:
    """Worker 0 finished while worker 1 was still training (it said done: out of the views), so
    worker 1 ended as its view's rank 0: the lowest live finished worker, 0, averages all the same."""
    c = cluster_of(3)
    for w in (0, 2, 1):
        c.workers[w].mark_finished()
    finals = [c.workers[w]._flat().clone() for w in range(3)]
    result: dict[str, bool] = {}
    averaged = lambda: bool(c.directory.collected)
    rank0 = threading.Thread(target=lambda: result.update(w1=c.workers[1].finalize(averaged)))
    rank0.start()
    assert c.workers[0].take_over(_never, _never)
    rank0.join(timeout=30)
    assert result == {"w1": False} and c.directory.collector == 0
    assert torch.equal(c.workers[0]._flat(), _avg(*finals))
    assert torch.equal(c.workers[1]._flat(), finals[1])


def test_the_directory_forgets_an_average_only_when_its_collector_dies() -> None:
    d = PeerDirectory(3)
    for w in range(3):
        d.handlers()["adpsgd_finish"][0](_Req({"worker_id": w, "tail": []}))
    d.handlers()["adpsgd_collected"][0](_Req({"worker_id": 0, "members": [0, 1, 2]}))
    d.on_dead(2)  # (a finished worker whose replica the average already holds: nothing changes)
    assert d.collected == (0, 1, 2) and d.gone == set()
    d.on_dead(0)
    assert d.collected is None and d.collector is None and d.gone == {0}
    assert d.handlers()["adpsgd_status"][0](_Req({}))["collected"] is False


def test_a_joiner_when_every_peer_finished_takes_a_final_state_and_stays_out_of_the_average(
    cluster_of: Any,
) -> None:
    """Respawned as the job ends: no live peer trains, so there is no replica to join -- before, it
    resumed from the newest checkpoint and that old state was averaged into the exported model.
    Now it takes a finished peer's final state and step, trains no further, and is a spectator."""
    c = cluster_of(3)
    late = joiner(c, 2)
    c.step(0, 0)
    c.step(1, 0)
    for w in (0, 1):
        c.workers[w].mark_finished()
    finals = [c.workers[w]._flat().clone() for w in (0, 1)]
    late.start()
    assert torch.equal(late._flat(), finals[0]) and late.joined_at() == c.workers[0]._step
    assert late.training_done()
    late.mark_finished()
    assert c.directory.spectators == {2} and c.directory.finished == {0, 1}
    assert c.workers[0].finalize(_never)  # (not waiting for worker 2, not averaging it in)
    assert c.directory.collected == (0, 1)
    assert torch.equal(c.workers[0]._flat(), _avg(*finals))
    assert not late.take_over(lambda: bool(c.directory.collected), _never)  # (never the collector)
