"""The AD-PSGD oracle: a single-process replay of a run from its records.

Every change of a replica's weights is a new version of it (``sync/adpsgd.py``), recorded by the
worker whose replica it is:

- an own step (the unit's record: ``adpsgd_v = [g, v, scale]``): the gradient of the unit's
  minibatch (step, rank and world size in the record: the sampler gives the samples) computed on
  version ``g`` of this replica, scaled, applied by this worker's optimizer to version ``v``;
- an average as the active side (``adpsgd_xid``, ``adpsgd_peer``, ``adpsgd_xv = [v, vp]``) and as
  the passive side (``adpsgd_served`` entries ``[xid, active, "committed", vp, v]``, and the
  directory's ``served_after_last_record`` for those after a worker's last record): both replicas,
  at those versions, become ``(x_a + x_p) / 2``.

The replay starts every replica from the job's initial weights, recomputes each gradient with
the runtime's own engine code (``ReplicaEngine.run_unit``) on the recorded version -- so the
staleness is checked, not only the averaging arithmetic -- and applies the events in an order
that respects every version (an exchange waits until both sides reach the recorded versions).  A
missing event, a version out of order or a pair that disagrees fails the replay.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from flotilla.cluster.emulation import SpeedEmulator
from flotilla.cluster.membership import View
from flotilla.config import RunConfig
from flotilla.sync.base import Outcome, Proposal, Regime, SyncStrategy, Traits
from flotilla.trainer import builders, optim
from flotilla.trainer.parts import UnitWhere
from flotilla.trainer.replica import ReplicaEngine
from flotilla.trainer.step import task_loss


class _Capture(SyncStrategy):
    """The gradient only: scaled as the runtime scales it, nothing applied."""

    kind = "adpsgd-replay"
    traits = Traits(regime=Regime.GROUPS, nominal_batch=True)

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.scale = model, 1.0

    def begin_step(self, step: int) -> None:
        self.model.zero_grad(set_to_none=True)

    def synchronize(self, proposal: Proposal = Proposal()) -> Outcome:
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None and self.scale != 1.0:
                    p.grad.mul_(self.scale)
        return Outcome(committed=True)


@dataclass
class _Replica:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    state: list[torch.Tensor]
    versions: dict[int, torch.Tensor] = field(default_factory=dict)
    version: int = 0
    events: dict[int, tuple[str, Any]] = field(default_factory=dict)  # version in -> event

    def flat(self) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).float() for t in self.state])

    def write(self, flat: torch.Tensor) -> None:
        at = 0
        with torch.no_grad():
            for t in self.state:
                t.copy_(flat[at : at + t.numel()].view_as(t).to(t.dtype))
                at += t.numel()


def _events(records: list[dict], tails: dict[str, list]) -> dict[int, dict[int, tuple[str, Any]]]:
    out: dict[int, dict[int, tuple[str, Any]]] = defaultdict(dict)

    def put(w: int, v: int, event: tuple[str, Any]) -> None:
        assert v not in out[w], f"worker {w}: two events at version {v}: {out[w][v]} and {event}"
        out[w][v] = event

    served: list[tuple[int, list]] = []
    for r in records:
        w = int(r["worker_id"])
        if r.get("adpsgd_outcome") == "committed" and r.get("adpsgd_xid"):
            v, vp = r["adpsgd_xv"]
            put(w, v, ("a", (r["adpsgd_xid"], int(r["adpsgd_peer"]), vp)))
        if r.get("adpsgd_v") is not None and r.get("committed"):
            g, v, scale = r["adpsgd_v"]
            put(w, v, ("s", (int(r["step"]), int(r["rank"]), int(r["world_size"]), int(g), float(scale))))
        served += [(w, e) for e in r.get("adpsgd_served", ())]
    served += [(int(w), e) for w, t in tails.items() for e in t]
    for w, (xid, active, outcome, v, va) in served:
        if outcome == "committed":
            put(w, v, ("p", (xid, int(active), va)))
    return out


def replay(cfg: RunConfig, records: list[dict], tails: dict[str, list]) -> dict[int, torch.Tensor]:
    """Every worker's final replica as the replay computes it (worker id -> flat weights), with
    one intra-op thread, as the workers computed (sums in the same order)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _replay(cfg, records, tails)
    finally:
        torch.set_num_threads(threads)


def _replay(cfg: RunConfig, records: list[dict], tails: dict[str, list]) -> dict[int, torch.Tensor]:
    task = builders.build_task(cfg)
    train, _ = builders.build_task_data(task)
    sampler = builders.task_sampler(cfg, train)
    total = builders.total_steps(cfg, sampler)
    events = _events(records, tails)
    replicas: dict[int, _Replica] = {}
    for w, evs in events.items():
        model = builders.build_task_model(cfg, task)
        opt = optim.build_optimizer(cfg, model, task, total_steps=total)
        state = [p for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]
        rep = _Replica(model, opt.optimizer, state, events=evs)
        rep.versions[0] = rep.flat()
        assert sorted(evs) == list(range(len(evs))), f"worker {w}: versions {sorted(evs)[:20]}... not 0..n-1"
        replicas[w] = rep
    scratch = builders.build_task_model(cfg, task)
    capture = _Capture(scratch)
    engine = ReplicaEngine(
        model=scratch, optimizer=torch.optim.SGD(scratch.parameters(), lr=0.0), train_data=train,
        sampler=sampler, loss_fn=task_loss(task), emulator=SpeedEmulator(1.0), device=torch.device("cpu"),
        seed=cfg.job.seed,
    )  # fmt: skip
    scratch_state = [p for p in scratch.parameters()] + [
        b for b in scratch.buffers() if b.is_floating_point()
    ]

    def own_step(rep: _Replica, data: tuple) -> None:
        step, rank, world, g, scale = data
        assert g <= rep.version, f"a gradient on version {g} applied at {rep.version}"
        at = 0
        with torch.no_grad():
            for t in scratch_state:
                t.copy_(rep.versions[g][at : at + t.numel()].view_as(t).to(t.dtype))
                at += t.numel()
        capture.scale = scale
        view = View(epoch=1, members=tuple(range(world)))
        engine.run_unit(UnitWhere(step, step, view, rank), capture, Proposal())
        for p, q in zip(rep.model.parameters(), scratch.parameters(), strict=True):
            p.grad = None if q.grad is None else q.grad.detach().clone()
        rep.optimizer.step()

    done = True
    while done:
        done = False
        for rep in replicas.values():
            ev = rep.events.get(rep.version)
            if ev is None:
                continue
            kind, data = ev
            if kind == "s":
                own_step(rep, data)
            elif kind == "a":
                xid, peer, vp = data
                other = replicas[peer]
                if other.version != vp:
                    continue  # (the passive has not reached the recorded version yet)
                mate = other.events.get(vp)
                assert mate is not None and mate[0] == "p" and mate[1][0] == xid, (xid, mate)
                assert mate[1][2] == rep.version, f"{xid}: the passive saw the active at {mate[1][2]}"
                avg = (other.flat() + rep.flat()) * 0.5  # (as the passive computes it)
                rep.write(avg)
                other.write(avg)
                other.version += 1
                other.versions[other.version] = other.flat()
            else:
                continue  # (a passive average happens with its active's event)
            rep.version += 1
            rep.versions[rep.version] = rep.flat()
            done = True
    stuck = {
        w: (rep.version, rep.events.get(rep.version))
        for w, rep in replicas.items()
        if rep.events.get(rep.version)
    }
    assert not stuck, f"the records cannot be ordered: {stuck}"
    return {w: rep.flat() for w, rep in replicas.items()}
