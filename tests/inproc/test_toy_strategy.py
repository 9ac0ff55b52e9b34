"""A strategy registered from a test runs through the real worker loop, and a worker swaps its
strategy at a step boundary (allreduce -> toy local SGD -> allreduce) -- threads, one process.

The toy: "local SGD, no sync" -- each replica steps its own optimizer on its own shard.  Adding it
takes one class and one ``registry.register`` call, as docs/architecture.md says."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from flotilla.comm.auth import generate_secret
from flotilla.config import load_config
from flotilla.core.errors import ConfigError
from flotilla.roles.coordinator import Coordinator
from flotilla.roles.worker import Worker, WorkerOptions
from flotilla.sync import registry
from flotilla.sync.allreduce import AllReduceConfig
from flotilla.sync.base import Outcome, SyncStrategy, Traits
from flotilla.sync.state import model_digest

pytestmark = pytest.mark.timeout(120)


class LocalSGD(SyncStrategy):
    kind = "toy_local"
    traits = Traits(collective=False)

    def __init__(self, optimizer: torch.optim.Optimizer, calls: list[str]) -> None:
        self.optimizer, self.calls = optimizer, calls

    def start(self) -> None:
        self.calls.append("start")

    def begin_step(self, step: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.calls.append(f"step {step}")

    def synchronize(self, *, pending_epoch: int = 0, stop: bool = False) -> Outcome:
        self.optimizer.step()
        return Outcome(committed=True, stop=stop)

    def record_fields(self) -> dict[str, Any]:
        return {"toy": True}

    def close(self) -> None:
        self.calls.append("close")


@pytest.fixture
def toy_calls():
    calls: dict[int, list[str]] = {}

    def factory(model, optimizer, config, ctx: registry.StrategyContext) -> SyncStrategy:
        assert config == {"note": "toy config"}
        return LocalSGD(optimizer, calls.setdefault(ctx.rank, []))

    registry.register("toy_local", factory)
    try:
        yield calls
    finally:
        registry.unregister("toy_local")


def test_registry_refuses_unknown_and_duplicate_kinds(toy_calls) -> None:
    assert {"allreduce", "ps", "toy_local"} <= set(registry.kinds())
    with pytest.raises(ConfigError, match="unknown 'nope'"):
        registry.build("nope", torch.nn.Linear(1, 1), None, None, None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="already registered"):
        registry.register("toy_local", lambda *a: None)  # type: ignore[arg-type,return-value]


def test_worker_switches_strategy_at_step_boundaries(toy_calls) -> None:
    cfg = load_config("examples/tiny.yaml", ["job.steps=20", "job.eval_every_steps=0"])
    secret = generate_secret()
    coord = Coordinator(cfg, secret).start()
    digests: dict[tuple[str, int], str] = {}
    kinds: dict[tuple[str, int], str] = {}
    codes: dict[str, int] = {}

    def policy(w: Worker) -> None:  # the test's switching "policy": fixed steps
        if w.step == 8:
            w.switch_strategy("toy_local", {"note": "toy config"})
        elif w.step == 14:
            w.switch_strategy("allreduce", AllReduceConfig(bucket_bytes=2**20, step_timeout_s=20.0))
        digests[(w.opts.name or "", w.step)] = model_digest(w.model)
        kinds[(w.opts.name or "", w.step)] = w.strategy.kind if w.strategy else ""

    def run(name: str) -> None:
        worker = Worker(WorkerOptions(coordinator=coord.address, secret=secret, name=name))
        worker.boundary_hooks.append(policy)
        codes[name] = worker.run()

    threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in ("w0", "w1")]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=100)
        assert not any(t.is_alive() for t in threads), "workers hung"
        final = coord.snapshot()["final"]
    finally:
        coord.close()
    assert codes == {"w0": 0, "w1": 0}
    assert final and final["steps"] == 20, final
    # the toy ran steps 8..13 on each replica, started once and closed once
    for rank in (0, 1):
        assert toy_calls[rank] == ["start"] + [f"step {s}" for s in range(8, 14)] + ["close"]
    assert kinds[("w0", 9)] == "toy_local" and kinds[("w0", 15)] == "allreduce"
    # local steps on different shards make the replicas differ; the switch back re-syncs them
    assert digests[("w0", 12)] != digests[("w1", 12)]
    for step in (5, 14, 17, 19):
        assert digests[("w0", step)] == digests[("w1", step)], step
