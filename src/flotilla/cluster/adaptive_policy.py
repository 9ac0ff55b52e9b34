"""The adaptive strategy policy (SPEC §7, Spotnik's third answer), pure: which strategy a job should
run given one snapshot of the cluster's metrics, with hysteresis.  No torch, no I/O, no clock: the
coordinator (or, in ring mode, the lowest live worker) and a simulator call the same code.

A policy is an ordered list of rules; each rule's condition is a conjunction of bounds on the
metrics -- a box -- and it names a target (an index into the job's strategy options).  The
first rule whose box holds the snapshot wins; the last rule is ``otherwise`` (the whole space).

Metrics (:class:`Metrics`):

- ``num_workers``: the live workers;
- ``straggler_ratio``: the slowest worker's median step time over the median of the workers'
  medians, over a window (:func:`straggler_ratio`; 1: even);
- ``revocation_rate``: workers lost per hour over a window (:func:`revocation_rate`).

Validation (:func:`check_rules`) refuses, naming the rule's index, a rule that can never match:
an empty box (e.g. ``num_workers_lt: 3`` with ``num_workers_ge: 5``), or one every snapshot of
which an earlier rule takes first (its box inside an earlier one: the order would make it dead).
With the ``otherwise`` rule last, every snapshot matches exactly one first rule.

Hysteresis (:func:`decide`): after a switch, the policy holds for ``dwell_steps`` steps; a
switch is only proposed when the first matching rule names a target other than the running one.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "METRICS",
    "Bound",
    "Decision",
    "Metrics",
    "PolicyError",
    "Rule",
    "check_rules",
    "decide",
    "first_match",
    "revocation_rate",
    "straggler_ratio",
]

# metric -> whether it is integral (bounds on it are tightened to integers)
METRICS: dict[str, bool] = {"num_workers": True, "straggler_ratio": False, "revocation_rate": False}


class PolicyError(ValueError):
    """A policy that cannot be decided: ``index`` is the rule's (0-based) position."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"rules[{index}]: {message}")
        self.index, self.message = index, message


@dataclass(frozen=True, slots=True)
class Metrics:
    num_workers: int
    straggler_ratio: float = 1.0
    revocation_rate: float = 0.0  # workers lost per hour

    def value(self, metric: str) -> float:
        return float(getattr(self, metric))


@dataclass(frozen=True, slots=True)
class Bound:
    """``lo <= value < hi`` (``lo_open``: ``lo < value``) on one metric."""

    metric: str
    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False

    def holds(self, v: float) -> bool:
        above = v > self.lo if self.lo_open else v >= self.lo
        return above and v < self.hi

    def empty(self) -> bool:
        if METRICS[self.metric]:  # integral (and >= 0): is some integer in the interval?
            if math.isinf(self.lo):
                smallest = 0
            else:
                smallest = max(0, math.floor(self.lo) + 1 if self.lo_open else math.ceil(self.lo))
            return not smallest < self.hi
        return not self.lo < self.hi

    def inside(self, other: Bound) -> bool:
        """Every value this bound admits, ``other`` admits too."""
        lo_ok = self.lo > other.lo or (self.lo == other.lo and (self.lo_open or not other.lo_open))
        return lo_ok and self.hi <= other.hi


@dataclass(frozen=True, slots=True)
class Rule:
    """``when``: the box (one bound per metric named; None: ``otherwise``); ``target``: the index
    of the strategy option it selects."""

    when: tuple[Bound, ...] | None
    target: int

    def holds(self, m: Metrics) -> bool:
        return self.when is None or all(b.holds(m.value(b.metric)) for b in self.when)

    def box(self) -> dict[str, Bound]:
        return {b.metric: b for b in self.when or ()}


def _box_inside(inner: Rule, outer: Rule) -> bool:
    """Every snapshot ``inner`` holds for, ``outer`` holds for too."""
    ib, ob = inner.box(), outer.box()
    for metric, bound in ob.items():
        if metric not in ib or not ib[metric].inside(bound):
            return False
    return True


def check_rules(rules: Sequence[Rule]) -> None:
    """``PolicyError`` naming the first rule that can never match (the module doc)."""
    if not rules:
        raise PolicyError(0, "a policy needs at least one rule (the last one 'otherwise')")
    for i, rule in enumerate(rules):
        last = i == len(rules) - 1
        if rule.when is None and not last:
            raise PolicyError(i, "'otherwise' must be the last rule (the rules after it could never match)")
        if last and rule.when is not None:
            raise PolicyError(i, "the last rule must be 'otherwise' (else some metrics would match no rule)")
        if rule.when is None:
            continue
        names = [b.metric for b in rule.when]
        if not names:
            raise PolicyError(i, "a rule's 'when' names no metric; use 'otherwise'")
        if len(set(names)) != len(names):
            raise PolicyError(i, "a metric is bounded twice in one rule; give each metric one range")
        for b in rule.when:
            if b.metric not in METRICS:
                raise PolicyError(i, f"unknown metric {b.metric!r}; allowed: {', '.join(METRICS)}")
            if b.empty():
                raise PolicyError(i, f"never matches: no {b.metric} satisfies its bounds")
        for j in range(i):
            earlier = rules[j]
            if earlier.when is not None and _box_inside(rule, earlier):
                raise PolicyError(
                    i, f"never matches: rule {j} matches first whenever it would (reorder them)"
                )


def first_match(rules: Sequence[Rule], m: Metrics) -> int:
    """The index of the first rule that holds for ``m`` (the last one always does)."""
    for i, rule in enumerate(rules):
        if rule.holds(m):
            return i
    raise PolicyError(len(rules) - 1, "no rule matched (the last rule must be 'otherwise')")


@dataclass(frozen=True, slots=True)
class Decision:
    """``target``: the option to switch to (None: stay); ``rule``: the rule that matched;
    ``why``: one line with the metrics that caused it."""

    target: int | None
    rule: int
    why: str


def decide(
    rules: Sequence[Rule],
    m: Metrics,
    *,
    running: int,
    step: int,
    last_switch_step: int | None,
    dwell_steps: int,
) -> Decision:
    """What the policy says at ``step``: switch to the first matching rule's target when it is
    not the ``running`` one and at least ``dwell_steps`` passed since the last switch."""
    i = first_match(rules, m)
    target = rules[i].target
    facts = (
        f"num_workers={m.num_workers} straggler_ratio={m.straggler_ratio:.2f} "
        f"revocation_rate={m.revocation_rate:.2f}/h"
    )
    if target == running:
        return Decision(None, i, f"rule {i} holds ({facts}): stay")
    if last_switch_step is not None and step - last_switch_step < dwell_steps:
        left = dwell_steps - (step - last_switch_step)
        return Decision(None, i, f"rule {i} holds ({facts}) but the dwell time has {left} steps left")
    return Decision(target, i, f"rule {i} holds ({facts})")


def straggler_ratio(step_times: Mapping[int, Sequence[float]]) -> float:
    """The slowest worker's median step time over the median of the workers' medians (1.0 with
    fewer than two workers reporting)."""
    medians = [statistics.median(ts) for ts in step_times.values() if ts]
    if len(medians) < 2:
        return 1.0
    middle = statistics.median(medians)
    return max(medians) / middle if middle > 0 else 1.0


def revocation_rate(lost_at_s: Sequence[float], *, now_s: float, window_s: float) -> float:
    """Workers lost per hour over the last ``window_s`` seconds (the times are the losses')."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    recent = sum(1 for t in lost_at_s if now_s - window_s <= t <= now_s)
    return recent * 3600.0 / window_s
