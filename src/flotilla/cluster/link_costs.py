"""What the emulated links cost (pure): ``comm/shaping.py``'s :class:`~flotilla.comm.shaping.LinkCosts`
over a :class:`~flotilla.cluster.spec.LinkModel`, with the latency-bandwidth functions of
``cluster/comm_cost.py`` that the pipeline planner and the simulator use -- one cost model for
what is planned, simulated and (with ``cluster.links.emulate``) run.

- a point-to-point message from ``a`` to ``b``: ``transfer_s`` over ``model.link(a, b)``;
- an all-reduce among members: ``ring_allreduce_s`` over the slowest link among them (the
  lowest bandwidth and the highest latency of any pair: what ``sim/model.link_among`` takes for
  the simulator's clusters);
- a broadcast: one ``transfer_s`` over the source's slowest link to the others (they receive at
  once);
- a message-plane message: the default link (the parameter servers and the coordinator are not
  among ``cluster.workers``, so no pair names them).
"""

from __future__ import annotations

from functools import lru_cache

from flotilla.cluster.comm_cost import BYTES_PER_S_PER_GBPS, ring_allreduce_s, transfer_s
from flotilla.cluster.spec import Link, LinkModel

__all__ = ["ModelCosts"]


class ModelCosts:
    """The costs of ``model``'s links (module doc)."""

    def __init__(self, model: LinkModel) -> None:
        self.model = model
        self._slowest = lru_cache(maxsize=256)(self._slowest_uncached)

    def p2p(self, src: str, dst: str) -> tuple[float, float]:
        link = self.model.link(src, dst)
        return link.latency_s, 1.0 / (link.bandwidth_gbps * BYTES_PER_S_PER_GBPS)

    def allreduce_s(self, members: tuple[str, ...], num_bytes: int) -> float:
        if len(members) < 2:
            return 0.0
        return ring_allreduce_s(len(members), num_bytes, self._slowest(members))

    def broadcast_s(self, members: tuple[str, ...], src: int, num_bytes: int) -> float:
        others = [m for i, m in enumerate(members) if i != src]
        return max((transfer_s(num_bytes, self.model.link(members[src], m)) for m in others), default=0.0)

    def message(self, me: str) -> tuple[float, float]:
        m = self.model
        return m.latency_s, 1.0 / (m.default_bandwidth_gbps * BYTES_PER_S_PER_GBPS)

    def _slowest_uncached(self, members: tuple[str, ...]) -> Link:
        links = [self.model.link(a, b) for i, a in enumerate(members) for b in members[i + 1 :]]
        return Link(
            bandwidth_gbps=min(link.bandwidth_gbps for link in links),
            latency_s=max(link.latency_s for link in links),
        )
