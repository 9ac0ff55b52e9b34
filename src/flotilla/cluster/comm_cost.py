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

- a message-plane message (parameter-server pushes and pulls, AD-PSGD's exchanges, controller
  messages) pays the network's transfer **and** the message plane's own software cost (signing,
  framing, copies), itself latency + bytes / rate: :func:`message_s` (no software cost given: the
  transfer alone).

The inverse, for ``flotilla calibrate``: :func:`fit_transfer_link` and :func:`fit_allreduce_link`
fit a link to measured (bytes, seconds) samples by least squares on the formula's linear form
(``t = a + b * bytes``), so the simulator predicts with the link this machine showed;
:func:`fit_software_cost` fits the message plane's own cost to its one-way times less the
network's over the same bytes.

No I/O, no clock, no torch.
"""

from __future__ import annotations

import itertools
import statistics

from flotilla.cluster.spec import Link

__all__ = [
    "BYTES_PER_S_PER_GBPS",
    "fit_allreduce_link",
    "fit_software_cost",
    "fit_transfer_link",
    "message_s",
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


def message_s(num_bytes: float, link: Link, software: Link | None = None) -> float:
    """One message-plane message of ``num_bytes`` over ``link``, plus the message plane's own cost
    ``software`` (a :func:`fit_software_cost` link; ``None``: nothing added)."""
    own = transfer_s(num_bytes, software) if software is not None else 0.0
    return transfer_s(num_bytes, link) + own


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


def ps_round_s(num_bytes: float, link: Link, software: Link | None = None) -> float:
    """One worker's push of ``num_bytes`` of gradients and pull of as many bytes of weights (its
    own link carries both, each a message-plane message: :func:`message_s`; the shards'
    queueing is :func:`shard_service_s`)."""
    return 2 * message_s(num_bytes, link, software)


def shard_service_s(num_bytes: float, num_shards: int, link: Link, software: Link | None = None) -> float:
    """The time one shard spends receiving one worker's push (its ``1 / num_shards`` of the bytes)
    over the shard's own link, and checking and decoding them (``software``'s rate): pushes to
    one shard are served one after another."""
    if num_shards < 1:
        raise ValueError(f"shard_service_s: num_shards must be >= 1, got {num_shards!r}")
    own = num_bytes / num_shards / _bytes_per_s(software) if software is not None else 0.0
    return num_bytes / num_shards / _bytes_per_s(link) + own


def _line(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``t = a + b * x`` through ``samples`` of ``(x, t)`` in *relative* error
    (weights ``1 / t**2``: a small message's microseconds count as much as a large one's
    milliseconds, so the fixed cost is not lost under the largest sizes): ``(a, b)``, each >= 0
    (a negative intercept or slope is measurement noise: clamped, the other refitted)."""
    if len({x for x, _ in samples}) < 2:
        raise ValueError(f"a fit needs samples at two sizes at least, got {samples!r}")
    w = [1.0 / max(t, 1e-7) ** 2 for _, t in samples]  # (a floor: a tenth of a us)
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, samples)) / sw
    mt = sum(wi * t for wi, (_, t) in zip(w, samples)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, samples))
    b = sum(wi * (x - mx) * (t - mt) for wi, (x, t) in zip(w, samples)) / sxx
    a = mt - b * mx
    if a < 0:  # through the origin
        a = 0.0
        sxt = sum(wi * x * t for wi, (x, t) in zip(w, samples))
        b = sxt / sum(wi * x * x for wi, (x, _) in zip(w, samples))
    if b <= 0:
        raise ValueError(f"the times do not grow with the size: {samples!r}")
    return a, b


def fit_transfer_link(samples: list[tuple[float, float]]) -> Link:
    """The link whose :func:`transfer_s` best fits ``samples`` of ``(bytes, one-way seconds)``."""
    a, b = _line(samples)
    return Link(bandwidth_gbps=1.0 / (b * BYTES_PER_S_PER_GBPS), latency_s=a)


# a software cost that does not grow with the bytes: "bandwidth" this high adds nothing measurable
_UNBOUNDED_GBPS = 1e9


def fit_software_cost(total: list[tuple[float, float]], network: list[tuple[float, float]]) -> Link:
    """The message plane's own cost as a link: fitted to ``total`` one-way times of its messages
    less the ``network`` one-way times of the same bytes (both ``(bytes, seconds)`` at the same
    sizes; a negative difference is noise: 0).  Each difference comes from two medians measured
    apart, so one of them can be far off (near 0, or clamped): the line is Theil-Sen's (the
    median of the pairwise slopes, then the median intercept), which one such size does not move,
    where least squares on five sizes follows it.  A cost that does not grow with the size is a
    fixed one (the differences' median, at an unbounded rate)."""
    net = dict(network)
    if sorted(net) != sorted(b for b, _ in total) or len(net) < 2:
        raise ValueError(f"fit_software_cost: need the same two or more sizes, got {total!r} and {network!r}")
    diffs = [(b, max(0.0, t - net[b])) for b, t in total]
    slope = statistics.median(
        (t2 - t1) / (x2 - x1) for (x1, t1), (x2, t2) in itertools.combinations(diffs, 2) if x2 != x1
    )
    if slope <= 0:  # (no growth with the size)
        return Link(bandwidth_gbps=_UNBOUNDED_GBPS, latency_s=statistics.median(t for _, t in diffs))
    latency = max(0.0, statistics.median(t - slope * b for b, t in diffs))
    return Link(bandwidth_gbps=1.0 / (slope * BYTES_PER_S_PER_GBPS), latency_s=latency)


def fit_allreduce_link(num_members: int, samples: list[tuple[float, float]]) -> Link:
    """The link whose :func:`ring_allreduce_s` over ``num_members`` (>= 2) best fits ``samples`` of
    ``(bytes, seconds)``: ``a = 2 (r - 1) latency``, ``b = 2 (r - 1) / (r * bytes_per_s)``."""
    if num_members < 2:
        raise ValueError(f"fit_allreduce_link: num_members must be >= 2, got {num_members!r}")
    a, b = _line(samples)
    r = num_members
    bytes_per_s = 2 * (r - 1) / (r * b)
    return Link(bandwidth_gbps=bytes_per_s / BYTES_PER_S_PER_GBPS, latency_s=a / (2 * (r - 1)))
