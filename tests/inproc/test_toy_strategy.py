"""Strategies registered from a test train through the REAL loop (``trainer/loop.py``, assembled by
the worker role; threads, one process, a real coordinator and gloo groups):

- ``toy_alone``: no barrier, no group -- each worker steps its own optimizer on its own shard;
- ``toy_pairs``: groups formed per step -- at every step the members are paired at random
  (seeded by the step, so every member computes the same pairing) and each pair averages its
  gradients over a group named by the pair's namespace;
- switching: an agreed switch (requested by ONE worker, carried by the all-reduce vote) and a
  planned one (a step fixed in advance, for a strategy without a barrier); every worker switches
  at the same step.

Adding a strategy takes one class and one ``registry.register`` call (docs/architecture.md).
"""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
import torch

from flotilla.comm.auth import generate_secret
from flotilla.config import load_config
from flotilla.core.errors import CollectiveError, ConfigError
from flotilla.roles.coordinator import Coordinator
from flotilla.roles.worker import Worker, WorkerOptions
from flotilla.sync import registry
from flotilla.sync.allreduce_settings import AllReduceStrategy
from flotilla.sync.base import Outcome, Proposal, Regime, SyncStrategy, Traits
from flotilla.sync.state import model_digest
from flotilla.trainer.boundary import SwitchAt

pytestmark = pytest.mark.timeout(120)


MADE: dict[int, Alone] = {}  # id(calls list) -> the last Alone made with it


class Alone(SyncStrategy):
    """No barrier: every worker steps alone."""

    kind = "toy_alone"
    traits = Traits(regime=Regime.GROUPS)  # (no group at all: a fixed set of workers, each alone)

    def __init__(self, optimizer: torch.optim.Optimizer, calls: list[str]) -> None:
        self.optimizer, self.calls = optimizer, calls
        self.left: list[torch.Tensor] = []
        MADE[id(calls)] = self

    def start(self) -> None:
        self.calls.append("start")

    def begin_step(self, step: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.calls.append(f"step {step}")

    def synchronize(self, proposal: Proposal) -> Outcome:
        self.optimizer.step()
        return Outcome.agreed_alone(proposal)

    def record_fields(self) -> dict[str, Any]:
        return {"toy": True}

    def close(self) -> None:
        if "close" not in self.calls:  # the weights it leaves behind (a switch averages them)
            self.left = [p.detach().clone() for g in self.optimizer.param_groups for p in g["params"]]
        self.calls.append("close")


def pairing(step: int, members: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The step's random pairs (a trailing odd member is alone); the same on every member."""
    order = list(members)
    random.Random(step).shuffle(order)
    return [tuple(sorted(order[i : i + 2])) for i in range(0, len(order), 2)]


class Pairs(SyncStrategy):
    """Groups formed per step: each pair averages its gradients in its own namespace."""

    kind = "toy_pairs"
    traits = Traits(regime=Regime.GROUPS)

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ctx: Any, log: list) -> None:
        self.model, self.optimizer, self.ctx, self.log = model, optimizer, ctx, log
        self.step = 0

    def begin_step(self, step: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.step = step

    def synchronize(self, proposal: Proposal) -> Outcome:
        me = self.ctx.worker_id
        pair = next(p for p in pairing(self.step, self.ctx.members) if me in p)
        if len(pair) == 2:
            namespace = f"toy_pairs/{self.ctx.epoch}/{pair[0]}-{pair[1]}"
            try:
                group = self.ctx.groups().get(namespace, pair, me)
                for p in self.model.parameters():
                    group.allreduce(p.grad)
                    p.grad /= 2  # (the loss is scaled by the global batch: the pair's mean)
            except CollectiveError as exc:
                return Outcome.group_failed(str(exc))
        self.log.append((self.step, pair))
        self.optimizer.step()
        return Outcome.agreed_alone(proposal)


@pytest.fixture
def toys():
    calls: dict[int, list[str]] = {}
    pairs_log: dict[int, list] = {}

    def alone(model, optimizer, config, ctx: registry.StrategyContext) -> SyncStrategy:
        assert config == {"note": "toy config"}
        return Alone(optimizer, calls.setdefault(ctx.worker_id, []))

    def pairs(model, optimizer, config, ctx: registry.StrategyContext) -> SyncStrategy:
        return Pairs(model, optimizer, ctx, pairs_log.setdefault(ctx.worker_id, []))

    registry.register("toy_alone", alone)
    registry.register("toy_pairs", pairs)
    try:
        yield calls, pairs_log
    finally:
        registry.unregister("toy_alone")
        registry.unregister("toy_pairs")


def test_registry_refuses_unknown_and_duplicate_kinds(toys) -> None:
    assert {"allreduce", "ps", "toy_alone"} <= set(registry.kinds())
    with pytest.raises(ConfigError, match="unknown 'nope'"):
        registry.build("nope", torch.nn.Linear(1, 1), None, None, None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="already registered"):
        registry.register("toy_alone", lambda *a: None)  # type: ignore[arg-type,return-value]


def _run(num_workers: int, steps: int, make_opts, on_boundary=None) -> tuple[dict, dict, dict, dict]:
    """Run ``num_workers`` worker threads; per (name, step) the model digest and strategy kind seen
    by a boundary hook; exit codes; the coordinator's final result.  ``on_boundary(coord, name,
    loop)``: called by every worker's boundary hook too."""
    cfg = load_config(
        "examples/tiny.yaml",
        [f"job.steps={steps}", "job.eval_every_steps=0", f"cluster.num_workers={num_workers}"],
    )
    secret = generate_secret()
    coord = Coordinator(cfg, secret).start()
    digests: dict[tuple[str | int, int], str] = {}  # (name or worker id, step) -> digest
    kinds: dict[tuple[str, int], str] = {}
    codes: dict[str, int] = {}

    def run(name: str) -> None:
        def seen(loop: Any, name: str = name) -> None:  # after every boundary: the step it reached
            digests[(name, loop.step)] = model_digest(loop.p.engine.model)
            digests[(loop.p.membership.worker_id, loop.step)] = digests[(name, loop.step)]
            kinds[(name, loop.step)] = loop.strategy.kind
            if on_boundary is not None:
                on_boundary(coord, name, loop)

        opts = make_opts(name, coord.address, secret)
        hooks = (*opts.get("boundary_hooks", ()), seen)
        worker = Worker(WorkerOptions(**{**opts, "boundary_hooks": hooks}))
        codes[name] = worker.run()

    names = [f"w{i}" for i in range(num_workers)]
    threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in names]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=100)
        assert not any(t.is_alive() for t in threads), "workers hung"
        final = coord.snapshot()["final"]
    finally:
        coord.close()
    return digests, kinds, codes, final


def _opts(name: str, address: str, secret: bytes, **kw: Any) -> dict[str, Any]:
    return {"coordinator": address, "secret": secret, "name": name, **kw}


def test_strategy_without_barrier_trains_through_the_loop(toys) -> None:
    """Planned switches: toy_alone from step 0, allreduce again for the last step (so the job ends
    with the replicas agreeing, and no worker can finish the job before the other started)."""
    calls, _ = toys
    options = (
        ("toy_alone", {"note": "toy config"}),
        ("allreduce", AllReduceStrategy(bucket_bytes=2**20, step_timeout_s=20.0)),
    )
    digests, kinds, codes, final = _run(
        2,
        12,
        lambda n, a, s: _opts(
            n,
            a,
            s,
            switch_options=options,
            switch_plan=(SwitchAt(step=0, option=1), SwitchAt(step=11, option=2)),
        ),
    )
    assert codes == {"w0": 0, "w1": 0}
    assert final and final["steps"] == 12, final
    # it ran steps 0..10 alone on each worker, started once and closed once
    for wid in (0, 1):
        assert calls[wid] == ["start"] + [f"step {s}" for s in range(11)] + ["close"], calls[wid]
    assert kinds[("w0", 5)] == "toy_alone" and kinds[("w0", 12)] == "allreduce"
    assert digests[("w0", 10)] != digests[("w1", 10)]  # different shards, no averaging
    assert digests[("w0", 12)] == digests[("w1", 12)]  # allreduce re-agreed on one state


def test_groups_formed_per_step_train_through_the_loop(toys) -> None:
    """toy_pairs from step 0, allreduce for the last step (so no worker ends the job early)."""
    _, pairs_log = toys
    options = (("toy_pairs", None), ("allreduce", AllReduceStrategy(bucket_bytes=2**20, step_timeout_s=20.0)))
    digests, kinds, codes, final = _run(
        4,
        10,
        lambda n, a, s: _opts(
            n,
            a,
            s,
            switch_options=options,
            switch_plan=(SwitchAt(step=0, option=1), SwitchAt(step=9, option=2)),
        ),
    )
    assert codes == {f"w{i}": 0 for i in range(4)}
    assert final and final["steps"] == 10, final
    members = (0, 1, 2, 3)
    for wid, log in pairs_log.items():
        assert [s for s, _ in log] == list(range(9)), log
        for step, pair in log:
            assert wid in pair and pair in pairing(step, members)
    # every replica starts from the same weights: after step 0 the two members of each of its
    # pairs hold the same weights (same mean gradient), and the two pairs differ
    (a0, b0), (a1, b1) = pairing(0, members)  # (worker ids)
    assert digests[(a0, 1)] == digests[(b0, 1)]
    assert digests[(a1, 1)] == digests[(b1, 1)]
    assert digests[(a0, 1)] != digests[(a1, 1)]


def test_agreed_switch_every_worker_switches_at_the_same_step(toys) -> None:
    """w1 alone asks (once, at a moment it picks) for option 1 (toy_alone); the all-reduce vote
    carries the request, so every worker switches at the same step.  Then a planned switch back to
    allreduce (option 2) at step 14: the replicas re-agree on a state (the most advanced one)."""
    calls, _ = toys
    requests: dict[str, list[int]] = {"w0": [], "w1": [], "w2": []}
    asked_at: dict[str, int] = {}

    def ask(loop: Any) -> None:  # a "policy" on w1 only, at step 5
        if loop.p.name == "w1" and loop.step == 5 and not asked_at:
            asked_at["w1"] = loop.step
            requests["w1"].append(1)

    options = (
        ("toy_alone", {"note": "toy config"}),
        ("allreduce", AllReduceStrategy(bucket_bytes=2**20, step_timeout_s=20.0)),
    )

    def make(n: str, a: str, s: bytes) -> dict[str, Any]:
        return _opts(
            n,
            a,
            s,
            switch_options=options,
            switch_plan=(SwitchAt(step=14, option=2),),
            switch_requests=requests[n],
            boundary_hooks=(ask,),
        )

    digests, kinds, codes, final = _run(3, 20, make)
    assert codes == {"w0": 0, "w1": 0, "w2": 0}
    assert final and final["steps"] == 20, final
    # the request made after step 4 rides the vote of step 5: toy_alone from step 6 on, everywhere
    switched = {n: min(s for (m, s), k in kinds.items() if m == n and k == "toy_alone") for n in requests}
    assert len(set(switched.values())) == 1, switched
    for wid in (0, 1, 2):
        steps = [int(c.split()[1]) for c in calls[wid] if c.startswith("step")]
        assert steps == list(range(switched["w0"], 14)), calls[wid]
    assert digests[("w0", 12)] != digests[("w1", 12)]  # local steps on different shards
    for step in (3, 15, 20):
        assert len({digests[(n, step)] for n in requests}) == 1, step
