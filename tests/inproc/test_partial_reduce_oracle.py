"""Partial Reduce runtime == the NumPy oracle: four worker threads (two fast, two slow) run the real
strategy (``sync/partial_reduce.py``) over real gloo groups, with the coordinator's controller
runtime (``sync/pr_service.py``) called in-process; their final models equal the oracle's
replay of the recorded gradients and groups (SPEC §5, DPR weights included)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from flotilla.comm.group_factory import GroupFactory
from flotilla.comm.store import StoreHost, connect_store
from flotilla.sync.partial_reduce import PartialReduce, PartialReduceConfig
from flotilla.sync.pr_plan import ControllerConfig
from flotilla.sync.pr_reference import GroupRecord, StepRecord, replay
from flotilla.sync.pr_service import PRController
from tests.inproc._replicas import make_data, make_model


class DirectLink:
    def __init__(self, ctrl: PRController, gate: threading.Event | None = None) -> None:
        self.ctrl = ctrl

    def call(self, op: str, body: dict | None = None, timeout_s: float = 10.0) -> dict:
        return self.ctrl.handle(op, dict(body or {}))


def flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().numpy()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("weighting", ["dynamic", "constant"])
def test_runtime_final_models_equal_the_oracle(weighting: str) -> None:
    n, steps, lr = 4, 12, 0.1
    cfg = PartialReduceConfig(
        group_size=2,
        weighting=weighting,
        alpha=0.5,
        group_timeout_s=0.05,
        step_timeout_s=30.0,
        bridge_after=0,
        grad_scale=1.0,
    )
    ctrl = PRController(
        ControllerConfig(group_size=2, group_timeout_s=0.05, alpha=cfg.effective_alpha, bridge_after=2), n
    )
    host = StoreHost("127.0.0.1")
    x, y = make_data()
    initial = {w: flat(make_model()) for w in range(n)}
    history: dict[int, list[StepRecord]] = {w: [] for w in range(n)}
    final: dict[int, np.ndarray] = {}
    errors: dict[int, BaseException] = {}
    slow = threading.Event()  # never set: a bounded wait that makes workers 2, 3 slower

    def worker(w: int) -> None:
        factory = GroupFactory(connect_store(host.address), timeout_s=20.0)
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        sync = PartialReduce(
            model, opt, cfg, worker_id=w, num_workers=n, link=DirectLink(ctrl), groups=lambda: factory
        )
        try:
            for s in range(steps):
                if w >= 2:
                    slow.wait(0.03)
                sync.begin_step(s)
                idx = (torch.arange(8) + 8 * (s * n + w)) % x.shape[0]
                torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().numpy().copy()
                out = sync.synchronize()
                assert out.committed
                a = sync.last_assignment
                group = None
                if sync.last_committed:
                    group = GroupRecord(int(a["group_id"]), tuple(a["members"]), tuple(a["weights"]))
                history[w].append(StepRecord(grad=grad, group=group))
            final[w] = flat(model)
        except BaseException as exc:  # (reported below)
            errors[w] = exc
        finally:
            sync.close()
            factory.close()

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    host.close()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    groups = {s.group.group_id: s.group for h in history.values() for s in h if s.group is not None}
    assert len(groups) >= 6, "too few committed groups to compare"
    if weighting == "dynamic":
        assert any(len(set(g.weights)) > 1 for g in groups.values()), "no group with unequal DPR weights"
    expected = replay(initial, history, lr)
    for w in range(n):
        np.testing.assert_allclose(final[w], expected[w], rtol=1e-5, atol=1e-6)
    # and the models did move apart from a plain local run: groups mattered
    assert not np.allclose(final[0], final[3])
    stats = ctrl.stats()
    assert stats["groups"] == len(groups) and stats["mean_group_size"] == 2.0
