"""Strategy ``adaptive``: the job switches between strategies at run time by a policy over the
cluster's metrics (SPEC §7; the pure policy is ``cluster/adaptive_policy.py``)::

    strategy:
      kind: adaptive
      rules:
        - when: {num_workers_lt: 6}
          use: {kind: allreduce}
        - when: {straggler_ratio_gt: 2}
          use: {kind: partial_reduce, group_size: 3}
        - otherwise: {kind: adpsgd}
      dwell_steps: 50

A rule's ``when`` bounds metrics (``<metric>_lt``, ``_le``, ``_gt``, ``_ge``; metrics:
``num_workers``, ``straggler_ratio``, ``revocation_rate`` per hour); ``use`` is a tagged strategy
section of the registry (validated as if it were the job's ``strategy:``); the last rule is
``otherwise``.  A rule that can never match, an unknown metric, a target without a data-parallel
worker: refused at ``flotilla validate``, naming ``strategy.rules[i]``.

This module holds the settings and their validation; the targets are the job's strategy options
(:meth:`AdaptiveStrategy.targets`), the first one the policy's choice for the cluster as
configured (:meth:`AdaptiveStrategy.initial_metrics`).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, model_validator

from flotilla.cluster.adaptive_policy import (
    METRICS,
    Bound,
    Decision,
    Metrics,
    PolicyError,
    Rule,
    check_rules,
    decide,
    first_match,
    revocation_rate,
    straggler_ratio,
)
from flotilla.cluster.launch_plan import LaunchNeeds
from flotilla.core.errors import ConfigError
from flotilla.core.log import get_logger
from flotilla.core.settings import Settings, fail
from flotilla.sync.spec import (
    JobSnapshot,
    RunFacts,
    ServiceFacts,
    StrategySettings,
    StrategySpec,
    settings_error,
)

__all__ = ["SPEC", "AdaptiveService", "AdaptiveStrategy", "TARGET_KINDS"]

log = get_logger("adaptive")
UNMEASURED_GRACE_S = 30.0  # how long the policy waits for a live worker's first time per unit

TARGET_KINDS = ("allreduce", "partial_reduce", "adpsgd", "diloco")
OPS = ("lt", "le", "gt", "ge")


class When(Settings):
    """Bounds on the metrics (all must hold)."""

    num_workers_lt: int | None = Field(default=None, ge=0, le=10**6)
    num_workers_le: int | None = Field(default=None, ge=0, le=10**6)
    num_workers_gt: int | None = Field(default=None, ge=0, le=10**6)
    num_workers_ge: int | None = Field(default=None, ge=0, le=10**6)
    straggler_ratio_lt: float | None = Field(default=None, ge=0, le=10**6)
    straggler_ratio_le: float | None = Field(default=None, ge=0, le=10**6)
    straggler_ratio_gt: float | None = Field(default=None, ge=0, le=10**6)
    straggler_ratio_ge: float | None = Field(default=None, ge=0, le=10**6)
    revocation_rate_lt: float | None = Field(default=None, ge=0, le=10**9)
    revocation_rate_le: float | None = Field(default=None, ge=0, le=10**9)
    revocation_rate_gt: float | None = Field(default=None, ge=0, le=10**9)
    revocation_rate_ge: float | None = Field(default=None, ge=0, le=10**9)

    def bounds(self) -> tuple[Bound, ...]:
        out = []
        for metric, integral in METRICS.items():
            lo, hi, lo_open, named = -math.inf, math.inf, False, False
            for op in OPS:
                v = getattr(self, f"{metric}_{op}")
                if v is None:
                    continue
                named = True
                if op == "lt":
                    hi = min(hi, v)
                elif op == "le":
                    hi = min(hi, v + 1 if integral else math.nextafter(v, math.inf))
                elif v > lo or (v == lo and op == "gt"):
                    lo, lo_open = v, op == "gt"
            if named:
                out.append(Bound(metric, lo, hi, lo_open))
        return tuple(out)


class RuleSettings(Settings):
    when: When | None = None
    use: dict[str, Any] | None = None
    otherwise: dict[str, Any] | None = None


class AdaptiveStrategy(StrategySettings):
    """Switch strategies at run time by a policy over the cluster's metrics (the module doc)."""

    kind: Literal["adaptive"] = "adaptive"
    rules: list[RuleSettings] = Field(min_length=1, max_length=64)
    dwell_steps: int = Field(default=50, ge=0, le=10**9)  # steps held after a switch
    every_s: float = Field(default=2.0, gt=0, le=3600)  # how often the policy looks at the metrics
    window_s: float = Field(default=30.0, gt=0, le=86400)  # the metrics' window
    _targets: tuple[StrategySettings, ...] = PrivateAttr(default=())
    _rules: tuple[Rule, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _policy(self) -> AdaptiveStrategy:
        targets: list[StrategySettings] = []
        rules: list[Rule] = []
        for i, r in enumerate(self.rules):
            if (r.use is None) == (r.otherwise is None) or (r.otherwise is not None and r.when is not None):
                raise fail("give either 'when' and 'use', or 'otherwise' alone", f"rules[{i}]")
            section = r.use if r.use is not None else r.otherwise
            assert section is not None
            target = _target(i, section)
            key = target.model_dump_json()
            index = next((k for k, t in enumerate(targets) if t.model_dump_json() == key), None)
            if index is None:
                targets.append(target)
                index = len(targets) - 1
            if r.when is not None and not r.when.bounds():
                allowed = ", ".join(f"{m}_{op}" for m in METRICS for op in OPS)
                raise fail(f"bounds no metric; allowed: {allowed}", f"rules[{i}].when")
            rules.append(Rule(r.when.bounds() if r.when is not None else None, index))
        try:
            check_rules(rules)
        except PolicyError as exc:
            raise fail(exc.message, f"rules[{exc.index}]") from None
        self._targets, self._rules = tuple(targets), tuple(rules)
        return self

    def collective_timeout_s(self) -> float:
        return max(t.collective_timeout_s() for t in self._targets)

    def targets(self) -> tuple[StrategySettings, ...]:
        """The distinct target strategies, in the order the rules name them first."""
        return self._targets

    def policy(self) -> tuple[Rule, ...]:
        return self._rules

    def initial(self, metrics: Metrics) -> int:
        """The index of the target the policy picks for ``metrics`` (at the start)."""
        return self._rules[first_match(self._rules, metrics)].target

    @staticmethod
    def initial_metrics(speeds: Sequence[float]) -> Metrics:
        """The metrics of the cluster as configured: its workers and their speeds' spread."""
        times = [1.0 / s for s in speeds if s > 0]
        ratio = max(times) / statistics.median(times) if len(times) >= 2 else 1.0
        return Metrics(num_workers=len(speeds), straggler_ratio=ratio)


def _target(i: int, section: Mapping[str, Any]) -> StrategySettings:
    from flotilla.sync import registry  # (the registry imports this module)

    kind = section.get("kind") if isinstance(section, Mapping) else None
    if kind not in TARGET_KINDS:
        raise fail(f"kind {kind!r} cannot be switched to; allowed: {', '.join(TARGET_KINDS)}", f"rules[{i}]")
    try:
        return registry.settings_of(section)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise fail(str(first["msg"]), f"rules[{i}].{where}") from None
    except ConfigError as exc:
        raise fail(str(exc), f"rules[{i}]") from None


class AdaptiveService:
    """The coordinator's side: the services of the target strategies (partial reduce's controller,
    AD-PSGD's directory: a worker may switch into any of them) and the policy, run every
    ``every_s`` on one snapshot of the job (:meth:`tick`); a switch is announced to every worker
    for a step none has reached (``ServiceFacts.announce``: the switch event)."""

    def __init__(self, settings: AdaptiveStrategy, facts: ServiceFacts, *, start: bool = True) -> None:
        from flotilla.sync import registry

        self.settings, self.facts = settings, facts
        self._targets = settings.targets()
        self._services = [
            spec.service(t, facts)
            for t in self._targets
            if (spec := registry.spec_of(t.kind)).service is not None
        ]
        self.running = settings.initial(AdaptiveStrategy.initial_metrics(facts.speeds))  # a target's index
        self.last_switch_step: int | None = None
        self.switches: list[dict[str, Any]] = []
        self._seen: dict[int, float] = {}  # live worker -> when the policy first saw it (now_s)
        self._lock = threading.Lock()
        log.info("adaptive: starting with %s", self._targets[self.running].kind)
        if start:
            threading.Thread(target=self._run, name="flotilla-adaptive", daemon=True).start()

    def handlers(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for service in self._services:
            for op, handler in service.handlers().items():
                if op in out:
                    raise ConfigError(f"strategy adaptive: two targets' services both answer {op!r}")
                out[op] = handler
        return out

    def on_dead(self, worker_id: int) -> None:
        for service in self._services:
            service.on_dead(worker_id)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {
                "running": self._targets[self.running].kind,
                "switches": list(self.switches),
            }
        for service in self._services:
            out.update(service.stats() or {})
        return out

    def _run(self) -> None:
        while not self.facts.stopped():
            time.sleep(self.settings.every_s)
            try:
                self.tick()
            except Exception:  # (the policy must never take the coordinator down)
                log.exception("adaptive: the policy failed; it tries again at its next look")

    def _unmeasured(self, snap: JobSnapshot) -> bool:
        """Whether a live worker has no time per unit yet (it is starting, or its first unit is
        still running -- the straggler's is the slowest): the straggler ratio of the others would
        say "even" and switch away from what the configured cluster chose.  Held for at most
        ``UNMEASURED_GRACE_S`` per worker (one that never reports does not stop the policy)."""
        for w in snap.live:
            self._seen.setdefault(w, snap.now_s)
        return any(
            w not in snap.compute_s and snap.now_s - self._seen[w] < UNMEASURED_GRACE_S for w in snap.live
        )

    def metrics(self, snap: JobSnapshot) -> Metrics:
        return Metrics(
            num_workers=len(snap.live),
            straggler_ratio=straggler_ratio({w: [s] for w, s in snap.compute_s.items()}),
            revocation_rate=revocation_rate(
                snap.lost_at_s, now_s=snap.now_s, window_s=self.settings.window_s
            ),
        )

    def tick(self) -> Decision | None:
        """Look at the job once; announce a switch if the policy says so."""
        if self.facts.snapshot is None or self.facts.announce is None:
            return None
        snap = self.facts.snapshot()
        if not snap.live or not snap.steps or self._unmeasured(snap):
            return None
        m, step = self.metrics(snap), max(snap.steps.values())
        # (only this thread changes running/last_switch_step; the lock guards stats' reads, and is
        # not held while announcing: announce takes the coordinator's lock, whose holder may be
        # reading stats -- one lock order)
        with self._lock:
            running, last = self.running, self.last_switch_step
        d = decide(
            self.settings.policy(), m, running=running, step=step,
            last_switch_step=last, dwell_steps=self.settings.dwell_steps,
        )  # fmt: skip
        if d.target is None:
            return d
        try:
            at = self.facts.announce(d.target + 1)  # (option 0 is the first strategy, again)
        except ValueError as exc:
            log.warning(
                "adaptive: %s: switch to %s not announced: %s", d.why, self._targets[d.target].kind, exc
            )
            return d
        came = self._targets[running].kind
        with self._lock:
            self.running, self.last_switch_step = d.target, at
            self.switches.append(
                {"step": at, "from": came, "to": self._targets[d.target].kind, "rule": d.rule,
                 "num_workers": m.num_workers, "straggler_ratio": round(m.straggler_ratio, 3),
                 "revocation_rate": round(m.revocation_rate, 3)}
            )  # fmt: skip
        log.info(
            "adaptive: %s: switch %s -> %s announced for step %d",
            d.why,
            came,
            self._targets[d.target].kind,
            at,
        )
        return d


def _options(settings: AdaptiveStrategy, facts: RunFacts) -> tuple[StrategySettings, ...]:
    """The workers' strategy options: the one the policy picks for the cluster as configured,
    then every target (option ``1 + i`` is target ``i``)."""
    targets = settings.targets()
    return (targets[settings.initial(AdaptiveStrategy.initial_metrics(facts.speeds))], *targets)


def _service(settings: AdaptiveStrategy, facts: ServiceFacts) -> AdaptiveService:
    return AdaptiveService(settings, facts)


def _check(settings: AdaptiveStrategy, facts: RunFacts) -> None:
    """Each target's own check against the run (e.g. a group size below the workers)."""
    from flotilla.sync import registry

    for i, target in enumerate(settings.targets()):
        try:
            registry.spec_of(target.kind).check(target, facts)
        except ConfigError as exc:
            raise settings_error(f"rules (target {i + 1}, {target.kind})", str(exc)) from None


SPEC = StrategySpec(
    kind="adaptive",
    settings=AdaptiveStrategy,
    build=None,
    check=_check,
    options=_options,
    service=_service,
    simulated="flotilla.sim.adaptive:adaptive_of",
    # (partial_reduce's and adpsgd's replicas differ: no one worker's state is the job's)
    launch=LaunchNeeds(
        gpu=True, durable_state="the replicas of the strategies it switches between (no job checkpoint yet)"
    ),
    summary="switches between allreduce, partial_reduce, adpsgd, diloco at run time by a policy on metrics",
)
