"""The latency-bandwidth cost of moving bytes (pure; SPEC §3.2, §9): the one communication model
the pipeline partitioner (``pipeline/plan.py``) and the simulator (``flotilla.sim``) both use.

A link is ``(bandwidth_gbps, latency_s)`` (:class:`~flotilla.cluster.spec.Link`); bandwidths are
gigabits per second (1e9 bit/s).  Formulas:

- a transfer of ``b`` bytes: ``latency + b / bandwidth``;
- a ring all-reduce of ``b`` bytes over ``r`` members (reduce-scatter then all-gather, each
  ``r - 1`` rounds of ``b / r`` bytes per member): ``2 (r - 1) / r * b / bandwidth + 2 (r - 1) *
  latency``, over the slowest link of the ring; 0 for one member;
- a parameter-server round (push the gradients, pull the weights) of ``b`` bytes split evenly over
  ``s`` shards, from one worker whose own link carries everything: ``2 * (latency + b / bandwidth)``
  -- the worker's side; a shard serves the pushes of many workers one after another, which the
  simulator models as a queue per shard (:func:`shard_service_s`).

The inverse, for ``flotilla calibrate``: :func:`fit_transfer_link` and :func:`fit_allreduce_link`
fit a link to measured (bytes, seconds) samples by least squares on the formula's linear form
(``t = a + b * bytes``), so the simulator predicts with the link this machine showed.

No I/O, no clock, no torch.
"""

from __future__ import annotations

from flotilla.cluster.spec import Link

__all__ = [
    "BYTES_PER_S_PER_GBPS",
    "fit_allreduce_link",
    "fit_transfer_link",
    "ps_round_s",
    "ring_allreduce_s",
    "shard_service_s",
    "transfer_s",
]

BYTES_PER_S_PER_GBPS = 1e9 / 8


def _bytes_per_s(link: Link) -> float:
    return link.bandwidth_gbps * BYTES_PER_S_PER_GBPS


def transfer_s(num_bytes: float, link: Link) -> float:
    """One message of ``num_bytes`` over ``link``."""
    if num_bytes < 0:
        raise ValueError(f"transfer_s: num_bytes must be >= 0, got {num_bytes!r}")
    return link.latency_s + num_bytes / _bytes_per_s(link)


def ring_allreduce_s(num_members: int, num_bytes: float, link: Link) -> float:
    """A ring all-reduce of ``num_bytes`` over ``num_members`` (``link``: the slowest of the ring)."""
    if num_members < 1 or num_bytes < 0:
        raise ValueError(
            f"ring_allreduce_s: need num_members >= 1, num_bytes >= 0, got {num_members}, {num_bytes}"
        )
    r = num_members
    if r < 2:
        return 0.0
    return 2 * (r - 1) / r * num_bytes / _bytes_per_s(link) + 2 * (r - 1) * link.latency_s


def ps_round_s(num_bytes: float, link: Link) -> float:
    """One worker's push of ``num_bytes`` of gradients and pull of as many bytes of weights (its
    own link carries both; the shards' queueing is :func:`shard_service_s`)."""
    return 2 * transfer_s(num_bytes, link)


def shard_service_s(num_bytes: float, num_shards: int, link: Link) -> float:
    """The time one shard spends receiving one worker's push (its ``1 / num_shards`` of the bytes)
    over the shard's own link: pushes to one shard are served one after another."""
    if num_shards < 1:
        raise ValueError(f"shard_service_s: num_shards must be >= 1, got {num_shards!r}")
    return num_bytes / num_shards / _bytes_per_s(link)


def _line(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``t = a + b * x`` through ``samples`` of ``(x, t)``: ``(a, b)``, each >= 0
    (a negative intercept or slope is measurement noise: clamped, the other refitted)."""
    if len({x for x, _ in samples}) < 2:
        raise ValueError(f"a fit needs samples at two sizes at least, got {samples!r}")
    n = len(samples)
    mx = sum(x for x, _ in samples) / n
    mt = sum(t for _, t in samples) / n
    sxx = sum((x - mx) ** 2 for x, _ in samples)
    b = sum((x - mx) * (t - mt) for x, t in samples) / sxx
    a = mt - b * mx
    if a < 0:  # through the origin
        a, b = 0.0, sum(x * t for x, t in samples) / sum(x * x for x, _ in samples)
    if b <= 0:
        raise ValueError(f"the times do not grow with the size: {samples!r}")
    return a, b


def fit_transfer_link(samples: list[tuple[float, float]]) -> Link:
    """The link whose :func:`transfer_s` best fits ``samples`` of ``(bytes, one-way seconds)``."""
    a, b = _line(samples)
    return Link(bandwidth_gbps=1.0 / (b * BYTES_PER_S_PER_GBPS), latency_s=a)


def fit_allreduce_link(num_members: int, samples: list[tuple[float, float]]) -> Link:
    """The link whose :func:`ring_allreduce_s` over ``num_members`` (>= 2) best fits ``samples`` of
    ``(bytes, seconds)``: ``a = 2 (r - 1) latency``, ``b = 2 (r - 1) / (r * bytes_per_s)``."""
    if num_members < 2:
        raise ValueError(f"fit_allreduce_link: num_members must be >= 2, got {num_members!r}")
    a, b = _line(samples)
    r = num_members
    bytes_per_s = 2 * (r - 1) / (r * b)
    return Link(bandwidth_gbps=bytes_per_s / BYTES_PER_S_PER_GBPS, latency_s=a / (2 * (r - 1)))
