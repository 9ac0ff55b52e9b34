"""PipeDream's partitioner extended to heterogeneous devices (pure; SPEC §3.2 and §2).

``partition(profile, cluster, options=...)`` (a ``ClusterSpec``; or ``partition(profile, devices,
links, options)``) returns the ``PipelinePlan`` that minimises the
bottleneck stage time max_i stage_s(i) of ``flotilla.pipeline.plan`` (ties: smaller sum of stage
times), subject to every device holding its stage in memory.  It chooses the number of stages, the
contiguous layer ranges, and WHICH devices run each stage (several = a replicated stage); devices
may stay unused when that is faster.

Dynamic program.  Devices are first grouped into classes of interchangeable devices: a and b are
in one class when swapping them changes no cost (same speed and memory, same link to every other
device); classes are the closure of such swaps.  A group of devices is then a vector of counts per
class.  Working backwards over layers:

    best(j, G, R, s) = the plan of layers [j, L) whose first stage starts at j on group G, whose
                       later stages use devices from R (disjoint from G), with exactly s stages;
    best(j, G, R, 1) = stage_s([j, L), G, no next stage)
    best(j, G, R, s) = min over k in (j, L-s+1], G' in R:  max(stage_s([j, k), G, G'),
                                                              best(k, G', R - G', s - 1))

and the answer is min over s, G of best(0, G, all - G, s).  A stage's memory depends on s
(= p - stage_idx) and, with vertical sync, on p itself, which is then fixed per outer run.
Cost: with c_t devices in class t, O(L^2 * n * prod_t C(c_t + 3, 3)) stage evaluations (4^n for n
distinct devices; cubic in the size of each class of identical devices).  Runs whose bound exceeds
``options.max_search_work`` are refused with a ``ConfigError`` rather than running for hours.

``brute_force_partition`` enumerates every split and assignment (exponential; the tests' oracle).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

from flotilla.core.errors import ConfigError
from flotilla.pipeline.plan import (
    ClusterSpec,
    CostModel,
    Devices,
    DeviceSpec,
    LinkModel,
    PairLink,
    PartitionOptions,
    PipelinePlan,
    PlanError,
    StagePlan,
    cluster_parts,
    evaluate_plan,
    format_bytes,
    memory_shortfalls,
)
from flotilla.pipeline.profile import ModelProfile

__all__ = [
    "ClusterSpec",
    "DeviceSpec",
    "LinkModel",
    "PairLink",
    "PartitionOptions",
    "PipelinePlan",
    "PlanError",
    "StagePlan",
    "brute_force_partition",
    "device_classes",
    "evaluate_plan",
    "format_plan",
    "partition",
]

Counts = tuple[int, ...]
_Best = tuple[float, float, "tuple[int, Counts] | None"]  # (bottleneck, total, (k, next group))


def _check_inputs(devices: Sequence[DeviceSpec], links: LinkModel) -> None:
    names = [d.name for d in devices]
    if not names:
        raise ConfigError("devices must name at least one device")
    if len(set(names)) != len(names):
        raise ConfigError(f"device names must be unique, got {names}")
    unknown = sorted(links.names() - set(names))
    if unknown:
        raise ConfigError(f"LinkModel.pairs name unknown device(s) {unknown}; devices are {names}")


def device_classes(devices: Sequence[DeviceSpec], links: LinkModel) -> list[tuple[int, ...]]:
    """Indices of interchangeable devices, grouped (classes in order of first member)."""
    n = len(devices)
    parent = list(range(n))

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def link(a: int, b: int) -> tuple[float, float]:
        na, nb = devices[a].name, devices[b].name
        return links.bandwidth_gbps(na, nb), links.link_latency_s(na, nb)

    for a, b in itertools.combinations(range(n), 2):
        da, db = devices[a], devices[b]
        if (da.speed, da.memory_bytes) != (db.speed, db.memory_bytes):
            continue
        if all(link(a, x) == link(b, x) for x in range(n) if x not in (a, b)):
            parent[root(b)] = root(a)
    classes: dict[int, list[int]] = {}
    for x in range(n):
        classes.setdefault(root(x), []).append(x)
    return [tuple(members) for members in classes.values()]


class _Search:
    """Memoised ``best(j, G, R, s)`` over class-count vectors (see the module docstring)."""

    def __init__(
        self,
        model: CostModel,
        devices: Sequence[DeviceSpec],
        classes: list[tuple[int, ...]],
        num_stages: int | None,
        minimise_shortfall: bool = False,
    ) -> None:
        self.model, self.devices, self.classes = model, devices, classes
        self.num_layers = model.profile.num_layers
        self.num_stages = num_stages
        # False: minimise time among plans that fit.  True: ignore time and find the plan whose
        # worst memory shortfall (need - capacity) is smallest (for the refusal message).
        self.minimise_shortfall = minimise_shortfall
        self.replicate = model.options.allow_replication
        self.memo: dict[tuple[int, Counts, Counts, int], _Best | None] = {}
        self._subs: dict[Counts, list[Counts]] = {}
        self._cache: dict[tuple[str, int, int, Counts] | tuple[str, int, Counts, Counts], float] = {}

    def groups(self, avail: Counts) -> list[Counts]:
        """Non-empty sub-groups of ``avail`` (singletons only without replication)."""
        if avail not in self._subs:
            subs = [c for c in itertools.product(*(range(a + 1) for a in avail)) if any(c)]
            self._subs[avail] = [c for c in subs if self.replicate or sum(c) == 1]
        return self._subs[avail]

    def members(self, counts: Counts, skip: Counts | None = None) -> list[DeviceSpec]:
        """Concrete representatives: the first counts[t] devices of class t after skip[t]."""
        skip = skip or (0,) * len(counts)
        return [self.devices[x] for t, c in enumerate(counts) for x in self.classes[t][skip[t] : skip[t] + c]]

    def compute(self, j: int, k: int, g: Counts) -> float:
        key = ("compute", j, k, g)
        if key not in self._cache:
            self._cache[key] = self.model.compute_s(j, k, self.members(g))
        return self._cache[key]

    def comm(self, k: int, g: Counts, nxt: Counts) -> float:
        key = ("comm", k, g, nxt)
        if key not in self._cache:
            self._cache[key] = self.model.comm_s(k, self.members(g), self.members(nxt, skip=g))
        return self._cache[key]

    def capacity(self, g: Counts) -> int:
        return min(self.devices[self.classes[t][0]].memory_bytes for t, c in enumerate(g) if c)

    def shortfall(self, j: int, k: int, g: Counts, s: int) -> int:
        """Bytes the stage [j, k) on g, s stages from the end, lacks (negative: spare)."""
        p = self.num_stages if self.num_stages is not None else s
        return self.model.memory_bytes(j, k, sum(g), s, p) - self.capacity(g)

    def fits(self, j: int, k: int, g: Counts, s: int) -> bool:
        return self.minimise_shortfall or self.shortfall(j, k, g, s) <= 0

    def cost(self, j: int, k: int, g: Counts, s: int, nxt: Counts | None) -> float:
        if self.minimise_shortfall:
            return float(self.shortfall(j, k, g, s))
        comm = self.comm(k, g, nxt) if nxt is not None else 0.0
        return self.model.stage_s(self.compute(j, k, g), comm)

    def best(self, j: int, g: Counts, rest: Counts, s: int) -> _Best | None:
        key = (j, g, rest, s)
        if key not in self.memo:
            self.memo[key] = self._solve(j, g, rest, s)
        return self.memo[key]

    def _solve(self, j: int, g: Counts, rest: Counts, s: int) -> _Best | None:
        num_layers = self.num_layers
        if s == 1:
            if not self.fits(j, num_layers, g, 1):
                return None
            time = self.cost(j, num_layers, g, 1, None)
            return (time, time, None)
        result: _Best | None = None
        for k in range(j + 1, num_layers - s + 2):
            if not self.fits(j, k, g, s):
                break  # memory only grows with k
            if result is not None and not self.minimise_shortfall and self.compute(j, k, g) > result[0]:
                break  # compute only grows with k, and stage_s >= compute
            for nxt in self.groups(rest):
                if sum(rest) - sum(nxt) < s - 2:
                    continue
                sub = self.best(k, nxt, tuple(a - b for a, b in zip(rest, nxt)), s - 1)
                if sub is None:
                    continue
                time = self.cost(j, k, g, s, nxt)
                cand = (max(time, sub[0]), time + sub[1], (k, nxt))
                if result is None or cand[:2] < result[:2]:
                    result = cand
        return result

    def run(self, stage_counts: Sequence[int]) -> tuple[_Best, Counts, int] | None:
        """Best (value, first group, number of stages) over the given stage counts."""
        total = tuple(len(c) for c in self.classes)
        found = None
        for s in stage_counts:
            for g in self.groups(total):
                if sum(total) - sum(g) < s - 1:
                    continue
                res = self.best(0, g, tuple(a - b for a, b in zip(total, g)), s)
                if res is not None and (found is None or res[:2] < found[0][:2]):
                    found = (res, g, s)
        return found

    def assignment(self, first: Counts, s: int) -> tuple[list[int], list[tuple[str, ...]]]:
        """Follow the memo from ``best(0, first, ., s)``: layer ends and concrete device names."""
        total = tuple(len(c) for c in self.classes)
        used = [0] * len(total)
        ends, groups = [], []
        j, g, rest = 0, first, tuple(a - b for a, b in zip(total, first))
        while True:
            groups.append(tuple(d.name for d in self.members(g, skip=tuple(used))))
            used = [u + c for u, c in zip(used, g)]
            choice = self.memo[(j, g, rest, s)]
            assert choice is not None
            if choice[2] is None:
                ends.append(self.num_layers)
                return ends, groups
            k, nxt = choice[2]
            ends.append(k)
            j, g, rest, s = k, nxt, tuple(a - b for a, b in zip(rest, nxt)), s - 1


def _work_bound(num_layers: int, classes: list[tuple[int, ...]], replicate: bool) -> int:
    n = sum(len(c) for c in classes)
    per_class = [math.comb(len(c) + 3, 3) if replicate else (len(c) + 1) ** 2 for c in classes]
    return num_layers * num_layers * n * math.prod(per_class)


def partition(
    profile: ModelProfile,
    devices: Devices,
    links: LinkModel | None = None,
    options: PartitionOptions | None = None,
) -> PipelinePlan:
    """The fastest plan that fits in memory on a ``ClusterSpec`` (or on ``devices`` joined by
    ``links``).  When none fits, raises ``PlanError`` naming each device that is short of memory,
    and by how many bytes, in the plan closest to fitting (the one whose worst shortfall is
    smallest, found by the same DP with memory shortfall as the stage cost)."""
    devices, links = cluster_parts(devices, links)
    options = options or PartitionOptions()
    _check_inputs(devices, links)
    classes = device_classes(devices, links)
    bound = _work_bound(profile.num_layers, classes, options.allow_replication)
    if bound > options.max_search_work:
        raise ConfigError(
            f"partitioning {profile.num_layers} layers over {len(devices)} devices in {len(classes)} classes "
            f"needs up to {bound} steps > PartitionOptions.max_search_work={options.max_search_work}; "
            "use fewer distinct device types, allow_replication=False, or raise max_search_work"
        )
    found = _search(profile, devices, links, options, classes, minimise_shortfall=False)
    if found is not None:
        return found
    closest = _search(profile, devices, links, options, classes, minimise_shortfall=True)
    assert closest is not None
    shortfalls = memory_shortfalls(closest, devices) or ["(no single device is short; memory model mismatch)"]
    raise PlanError(
        f"no partition of {profile.num_layers} layers over {len(devices)} device(s) fits in memory; "
        f"in the plan closest to fitting, " + "; ".join(shortfalls)
    )


def _search(
    profile: ModelProfile,
    devices: Sequence[DeviceSpec],
    links: LinkModel,
    options: PartitionOptions,
    classes: list[tuple[int, ...]],
    minimise_shortfall: bool,
) -> PipelinePlan | None:
    model = CostModel(profile, links, options)
    max_stages = min(len(devices), profile.num_layers)
    if options.memory_needs_num_stages:
        runs = [
            (_Search(model, devices, classes, p, minimise_shortfall), [p]) for p in range(1, max_stages + 1)
        ]
    else:
        runs = [(_Search(model, devices, classes, None, minimise_shortfall), list(range(1, max_stages + 1)))]
    best: tuple[tuple[float, float], PipelinePlan] | None = None
    for search, stage_counts in runs:
        found = search.run(stage_counts)
        if found is None:
            continue
        ends, groups = search.assignment(found[1], found[2])
        plan = evaluate_plan(profile, devices, links, options, ends, groups)
        if not minimise_shortfall and not math.isclose(
            plan.bottleneck_s, found[0][0], rel_tol=1e-9, abs_tol=1e-15
        ):
            raise AssertionError(f"partition DP value {found[0][0]} != plan cost {plan.bottleneck_s}")
        if best is None or found[0][:2] < best[0]:
            best = (found[0][:2], plan)
    return best[1] if best else None


def _assignments(names: Sequence[str], num_stages: int, replicate: bool) -> Iterator[list[tuple[str, ...]]]:
    """Every ordered tuple of ``num_stages`` disjoint non-empty device groups (unused devices allowed)."""
    for labels in itertools.product(range(num_stages + 1), repeat=len(names)):
        groups = [tuple(n for n, lab in zip(names, labels) if lab == i) for i in range(num_stages)]
        if all(groups) and (replicate or all(len(g) == 1 for g in groups)):
            yield groups


def brute_force_partition(
    profile: ModelProfile,
    devices: Devices,
    links: LinkModel | None = None,
    options: PartitionOptions | None = None,
) -> PipelinePlan | None:
    """Naive oracle: evaluate every contiguous split and device assignment; None if none fits."""
    devices, links = cluster_parts(devices, links)
    options = options or PartitionOptions()
    _check_inputs(devices, links)
    num_layers, names = profile.num_layers, [d.name for d in devices]
    best: PipelinePlan | None = None
    for p in range(1, min(len(devices), num_layers) + 1):
        for cuts in itertools.combinations(range(1, num_layers), p - 1):
            for groups in _assignments(names, p, options.allow_replication):
                plan = evaluate_plan(profile, devices, links, options, (*cuts, num_layers), groups)
                if memory_shortfalls(plan, devices):
                    continue
                if best is None or (plan.bottleneck_s, plan.total_stage_s) < (
                    best.bottleneck_s,
                    best.total_stage_s,
                ):
                    best = plan
    return best


def format_plan(plan: PipelinePlan) -> str:
    """A fixed-width table of the plan for ``flotilla plan`` (``*`` marks the bottleneck)."""
    header = ("stage", "layers", "devices", "compute_s", "allreduce_s", "comm_s", "stage_s", "memory/device")
    rows = [
        (
            f"{s.stage_idx}{'*' if s.stage_idx == plan.bottleneck_stage else ''}",
            s.layers_label,
            ",".join(s.devices),
            f"{s.compute_s:.6g}",
            f"{s.allreduce_s:.6g}",
            f"{s.comm_s:.6g}",
            f"{s.stage_s:.6g}",
            format_bytes(s.memory_bytes),
        )
        for s in plan.stages
    ]
    widths = [max(len(str(row[c])) for row in (header, *rows)) for c in range(len(header))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in (header, *rows)]
    micro = f", {plan.num_microbatches} microbatches" if plan.num_microbatches > 1 else ""
    lines += [
        f"schedule: {plan.schedule.value}{micro}; {plan.num_stages} stage(s)",
        f"bottleneck: stage {plan.bottleneck_stage} ({plan.bottleneck_s:.6g} s per minibatch)",
        f"predicted step: {plan.predicted_step_s:.6g} s per minibatch of {plan.batch_size}; "
        f"throughput {plan.throughput_samples_per_s:.6g} samples/s",
    ]
    if plan.unused_devices:
        lines.append(f"unused devices: {', '.join(plan.unused_devices)}")
    return "\n".join(lines)
