"""Strategy ``diloco`` on real gloo groups (threads in one process): the outer step equals a
single-process reference of the algorithm, replicas are bitwise identical after every outer step,
a failed vote discards the unit everywhere (weights, inner state and buffers as at its start) and
its redo equals an undisturbed run, and the outer momentum is state that travels."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from flotilla.comm.collective import EpochGroup
from flotilla.comm.store import StoreHost, connect_store
from flotilla.sync.diloco import DiLoCo, DiLoCoStrategy
from flotilla.sync.state import model_digest
from flotilla.trainer.step import Minibatch, run_unit

from ._replicas import make_data, make_model

pytestmark = pytest.mark.timeout(120)

H, BATCH = 3, 24
SETTINGS = DiLoCoStrategy(inner_steps=H, outer_lr=0.7, outer_momentum=0.9)


def _unit(x: torch.Tensor, y: torch.Tensor, unit: int, w: int, n: int) -> list[Minibatch]:
    out = []
    for s in range(unit * H, (unit + 1) * H):
        idx = torch.arange(s * BATCH, (s + 1) * BATCH) % x.shape[0]
        mine = idx.tensor_split(n)[w]
        out.append(Minibatch(s, x[mine], y[mine]))
    return out


def _run(
    n: int, units: int, fault: Callable[[int, int], bool] | None = None
) -> tuple[dict[int, list[tuple[int, bool, str]]], dict[int, list[torch.Tensor]], dict[int, DiLoCo]]:
    """``n`` replicas for ``units`` outer steps (a discarded unit is redone); per worker the log of
    (unit, committed, digest), the final parameters and the strategy.  ``fault(worker, unit)``:
    inject a local failure into that worker's first attempt of that unit."""
    host = StoreHost("127.0.0.1")
    x, y = make_data()
    logs: dict[int, list[tuple[int, bool, str]]] = {w: [] for w in range(n)}
    final: dict[int, list[torch.Tensor]] = {}
    strategies: dict[int, DiLoCo] = {}
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            group = EpochGroup(connect_store(host.address), epoch=1, rank=w, world_size=n, timeout_s=20)
            model = make_model()
            inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            tried: set[int] = set()
            at = [0]  # the unit running

            class Faults:  # (comm.collective.CollectiveFaults: this worker's vote fails)
                def launching(self, group: Any) -> None:
                    pass

                def voting(self, group: Any, tensor: torch.Tensor) -> None:
                    if fault is not None and fault(w, at[0]) and at[0] not in tried:
                        tried.add(at[0])
                        tensor[0] = 1.0

            group.faults = Faults()
            sync = DiLoCo(model, inner, SETTINGS)
            sync.bind(group)
            strategies[w] = sync
            unit = 0
            while unit < units:
                at[0] = unit
                res = run_unit(model, sync, _unit(x, y, unit, w, n), global_batch=BATCH)
                assert not res.decision.broken, res.decision.reason
                logs[w].append((unit, res.decision.committed, model_digest(model)))
                unit += res.decision.committed
            final[w] = [p.detach().clone() for p in model.parameters()]
            group.close()
        except BaseException as exc:  # (reported by the test thread)
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    host.close()
    assert not errors, errors
    return logs, final, strategies


def _reference(n: int, units: int) -> list[torch.Tensor]:
    """DiLoCo written out in one process: every worker's own model and inner SGD (with its
    momentum), the mean pseudo-gradient, a Nesterov outer SGD on the shared weights."""
    x, y = make_data()
    shared = make_model()
    outer = torch.optim.SGD(shared.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    local = [make_model() for _ in range(n)]
    inner = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in local]
    for unit in range(units):
        deltas = []
        for w in range(n):
            with torch.no_grad():
                for p, q in zip(local[w].parameters(), shared.parameters()):
                    p.copy_(q)
            for mb in _unit(x, y, unit, w, n):
                inner[w].zero_grad()
                loss = nn.functional.cross_entropy(local[w](mb.x), mb.y, reduction="sum") / BATCH
                (loss * n).backward()  # the worker's mean gradient (an even split)
                inner[w].step()
            deltas.append(
                [q.detach() - p.detach() for p, q in zip(local[w].parameters(), shared.parameters())]
            )
        for i, q in enumerate(shared.parameters()):
            q.grad = sum(d[i] for d in deltas) / n
        outer.step()
    return [p.detach().clone() for p in shared.parameters()]


def test_outer_steps_match_the_reference_and_replicas_stay_identical() -> None:
    logs, final, strategies = _run(3, 4)
    for unit in range(4):
        assert len({logs[w][unit][2] for w in range(3)}) == 1, f"replicas differ after outer step {unit}"
    assert all(s.outer_steps == 4 for s in strategies.values())
    for got, want in zip(final[0], _reference(3, 4), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_failed_vote_discards_everywhere_and_its_redo_equals_an_undisturbed_run() -> None:
    clean, clean_final, _ = _run(2, 4)
    logs, final, _ = _run(2, 4, fault=lambda w, unit: (w, unit) == (1, 2))
    for w in range(2):
        assert [(u, c) for u, c, _ in logs[w]] == [(0, True), (1, True), (2, False), (2, True), (3, True)]
        # the discarded unit left the weights of its start (the end of unit 1) on every worker
        assert logs[w][2][2] == logs[w][1][2]
    for got, want in zip(final[0], clean_final[0], strict=True):
        assert torch.equal(got, want), "the redone run differs from the undisturbed one"
    assert logs[0][-1][2] == clean[0][-1][2]


def test_the_outer_momentum_is_state_that_a_joiner_takes() -> None:
    _, _, strategies = _run(2, 2)
    state = strategies[0].state_dict()
    assert int(state["outer_steps"]) == 2 and any(k.startswith("momentum.") for k in state)
    fresh = DiLoCo(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1), SETTINGS)
    fresh.load_state_dict(state)
    assert fresh.outer_steps == 2
    for i, p in enumerate(fresh.params):
        assert torch.equal(fresh.outer.state[p]["momentum_buffer"], state[f"momentum.{i}"])
    with pytest.raises(ValueError, match="unknown entries"):
        fresh.load_state_dict({"bogus": torch.zeros(1)})
    with pytest.raises(ValueError, match="momentum.0 has shape"):
        fresh.load_state_dict({"momentum.0": torch.zeros(1)})
