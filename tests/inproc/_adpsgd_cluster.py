"""AD-PSGD strategy instances in one process, over the in-process message plane and the
worker's own ``roles/strategy_peers`` adapter, with the coordinator's directory behind an
in-process link (``tests/inproc/test_adpsgd_*.py``; the fixture ``cluster_of``: conftest)."""

from __future__ import annotations

import time
from itertools import count
from typing import Any

import torch
from torch import nn

from flotilla.comm import auth
from flotilla.comm.msgplane import serve
from flotilla.roles.strategy_peers import StrategyPeers
from flotilla.sync.adpsgd import ADPSGD, ADPSGDStrategy
from flotilla.sync.adpsgd_service import PeerDirectory
from flotilla.sync.base import Proposal

SECRET = auth.generate_secret()
C = 2.0**-4  # each own step subtracts exactly this from every weight (SGD lr 1, gradient C)
_names = count()


class _Req:
    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body


class Link:
    """The coordinator link, in process: the strategy's service."""

    def __init__(self, directory: PeerDirectory) -> None:
        self.directory = directory
        self.handlers = directory.handlers()

    def call(self, op: str, body: dict | None = None, timeout_s: float = 10.0) -> dict:
        return self.handlers[op][0](_Req(body or {}))


class Cluster:
    def __init__(self, n: int, *, timeout_s: float = 1.0, attempts: int = 2) -> None:
        tag = next(_names)
        self.addresses = {w: f"mem://adpsgd-{tag}-{w}" for w in range(n)}
        self.servers = {w: serve(SECRET, a, name=f"w{w}").start() for w, a in self.addresses.items()}
        self.directory = PeerDirectory(n)
        self.link = Link(self.directory)
        self.gone: set[int] = set()
        settings = ADPSGDStrategy(exchange_timeout_s=timeout_s, attempts=attempts, status_every=1)
        self.models: dict[int, nn.Module] = {}
        self.workers: dict[int, ADPSGD] = {}
        for w in range(n):
            torch.manual_seed(w)
            model = nn.Linear(6, 3)
            self.models[w] = model
            peers = StrategyPeers(self.servers[w], self.addresses.get, SECRET, f"w{w}")
            self.workers[w] = ADPSGD(
                model, torch.optim.SGD(model.parameters(), lr=1.0), settings,
                worker_id=w, members=tuple(range(n)), num_workers=1, peers=peers, link=self.link,
                gone=lambda: frozenset(self.gone),
            )  # fmt: skip

    def total(self) -> torch.Tensor:
        return sum((w._flat().double() for w in self.workers.values()), torch.zeros(1, dtype=torch.float64))

    def step(self, w: int, step: int, compute_s: float = 0.0) -> None:
        s = self.workers[w]
        s.begin_step(step)
        if compute_s:
            time.sleep(compute_s)
        for p in self.models[w].parameters():
            p.grad = torch.full_like(p, C)
        s.synchronize(Proposal())

    def close(self) -> None:
        self.directory.collected = self.directory.collected or ()  # (finished workers stop serving)
        for s in self.workers.values():
            s.close()
        for srv in self.servers.values():
            srv.close()


def joiner(c: Cluster, w: int) -> ADPSGD:
    """Worker ``w`` of ``c`` rebuilt as a newcomer (``joined``): it holds no replica yet."""
    torch.manual_seed(100 + w)
    model = nn.Linear(6, 3)
    c.models[w] = model
    c.workers[w].close()
    c.servers[w].close()  # (a new process: a new peer server)
    c.addresses[w] = f"{c.addresses[w]}-new"
    c.servers[w] = serve(SECRET, c.addresses[w], name=f"w{w}-new").start()
    peers = StrategyPeers(c.servers[w], c.addresses.get, SECRET, f"w{w}-new")
    settings = ADPSGDStrategy(exchange_timeout_s=1.0, attempts=2, status_every=1, final_timeout_s=5.0)
    c.workers[w] = ADPSGD(
        model, torch.optim.SGD(model.parameters(), lr=1.0), settings, worker_id=w,
        members=tuple(c.addresses), num_workers=1, peers=peers, link=c.link, gone=lambda: frozenset(c.gone),
        joined=True,
    )  # fmt: skip
    return c.workers[w]
