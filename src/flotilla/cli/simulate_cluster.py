"""A training config's cluster as ``flotilla simulate`` simulates it (``cli/simulate_inputs.py``
uses it): the workers grouped into device classes of one type, speed and memory
(:func:`sim_cluster`, scaled to ``--num-workers`` with :func:`scaled`), the configured links
reduced to the simulator's two (:func:`node_links`), and which simulated device stands for
which worker (:func:`device_names`)."""

from __future__ import annotations

from typing import Any

from flotilla.core.errors import ConfigError

__all__ = ["device_names", "node_links", "scaled", "sim_cluster"]


def scaled(counts: list[int], total: int) -> list[int]:
    """``counts`` scaled in proportion to sum to ``total`` (each at least 1)."""
    if total < len(counts):
        raise ConfigError(f"--num-workers: at least one per device class ({len(counts)}), got {total}")
    whole = sum(counts)
    out = [max(1, round(c * total / whole)) for c in counts]
    out[-1] = max(1, out[-1] + total - sum(out))
    return out


def sim_cluster(cfg: Any, num_workers: int | None, prices: dict[str, float]) -> Any:
    """The configured cluster as device classes (workers of one type and speed; see the module
    doc); ``num_workers``: every class scaled to that total."""
    from flotilla.cluster.emulation import TransientSlowdown
    from flotilla.sim.model import DeviceClass, SimCluster

    spec = cfg.cluster.spec()
    groups = _classes_of(spec)
    counts = [len(g) for g in groups.values()]
    if num_workers is not None:
        counts = scaled(counts, num_workers)
    unknown = sorted(set(prices) - {t for t, _, _ in groups})
    if unknown:
        raise ConfigError(
            f"--price: no worker has type {unknown[0]!r}; types: {sorted({t for t, _, _ in groups})}"
        )
    types = [t for t, _, _ in groups]
    classes = []
    for ((kind, speed, memory), members), count in zip(groups.items(), counts):
        label = kind if types.count(kind) == 1 else f"{kind}@{speed:g}"
        if [k for k, _, _ in groups].count(kind) > len({(k, v) for k, v, _ in groups if k == kind}):
            label += f"@{memory // 2**20}MiB"  # (one type and speed in several memory sizes)
        per_node = max(sum(1 for m in members if m.node == n) for n in {m.node for m in members})
        classes.append(
            DeviceClass(
                type=label,
                count=count,
                speed=speed,
                per_node=per_node,
                price_per_hour=prices.get(kind, 0.0),
                memory_bytes=int(memory),
            )  # fmt: skip
        )
    intra, inter = node_links(spec)
    slow = cfg.cluster.defaults.slowdown
    slowdown = TransientSlowdown.of(slow, 0) if slow is not None else None
    return SimCluster(classes=tuple(classes), intra_node=intra, inter_node=inter, slowdown=slowdown)


def node_links(spec: Any) -> tuple[Any, Any]:
    """The configured links as the simulator's two (``SimCluster.intra_node``, ``inter_node``):
    each the slowest of its kind -- the lowest bandwidth and the highest latency among the pairs
    of devices on one node (between nodes), a pair the ``pairs`` do not name taking the defaults.
    A kind with no pair of devices gets the defaults."""
    from collections import Counter

    from flotilla.cluster.spec import Link

    links, node = spec.links, {d.name: d.node for d in spec.devices}
    default = Link(bandwidth_gbps=links.default_bandwidth_gbps, latency_s=links.latency_s)
    per_node = Counter(node.values())
    same_pairs = sum(k * (k - 1) // 2 for k in per_node.values())
    n = len(node)
    counts = {True: same_pairs, False: n * (n - 1) // 2 - same_pairs}
    named: dict[bool, list[Any]] = {True: [], False: []}
    for p in links.pairs:
        if p.a in node and p.b in node:
            named[node[p.a] == node[p.b]].append(links.link(p.a, p.b))
    out = []
    for same in (True, False):
        kind = named[same] + ([default] if len(named[same]) < counts[same] or not counts[same] else [])
        out.append(
            Link(bandwidth_gbps=min(k.bandwidth_gbps for k in kind), latency_s=max(k.latency_s for k in kind))
        )
    return out[0], out[1]


def device_names(cfg: Any, cluster: Any) -> dict[str, str]:
    """The simulated device of each configured worker (:func:`sim_cluster` keeps the workers'
    order within each class; a class scaled below a worker's position leaves that worker out)."""
    out: dict[str, str] = {}
    for members, c in zip(_classes_of(cfg.cluster.spec()).values(), cluster.classes):
        out.update({d.name: f"{c.type}-{i}" for i, d in enumerate(members) if i < c.count})
    return out


def _classes_of(spec: Any) -> dict[tuple[str, float, int], list[Any]]:
    """The cluster's devices by (type, speed, memory), in the workers' order: the simulated
    device classes (:func:`sim_cluster`) and which worker is which device (:func:`device_names`)."""
    groups: dict[tuple[str, float, int], list[Any]] = {}
    for d in spec.devices:
        groups.setdefault((d.type, d.speed, d.memory_bytes), []).append(d)
    return groups
