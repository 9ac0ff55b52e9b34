"""The adaptive policy, pure (``cluster/adaptive_policy.py``) and its settings (``sync/adaptive.py``):
first-match rules over metric boxes, refusals naming the rule, hysteresis, the metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from flotilla.cluster.adaptive_policy import (
    Bound,
    Metrics,
    PolicyError,
    Rule,
    check_rules,
    decide,
    first_match,
    revocation_rate,
    straggler_ratio,
)
from flotilla.config import load_config
from flotilla.core.errors import ConfigError
from flotilla.sync.adaptive import AdaptiveStrategy

ROOT = Path(__file__).resolve().parents[2]

EXAMPLE = {
    "rules": [
        {"when": {"num_workers_lt": 6}, "use": {"kind": "allreduce"}},
        {"when": {"straggler_ratio_gt": 2}, "use": {"kind": "partial_reduce", "group_size": 3}},
        {"otherwise": {"kind": "adpsgd"}},
    ],
    "dwell_steps": 50,
}

OTHERWISE = {"otherwise": {"kind": "adpsgd"}}
metrics = st.builds(
    Metrics,
    num_workers=st.integers(0, 64),
    straggler_ratio=st.floats(1.0, 10.0),
    revocation_rate=st.floats(0.0, 100.0),
)


def test_the_example_policy_picks_by_size_then_spread() -> None:
    a = AdaptiveStrategy.model_validate(EXAMPLE)
    assert [t.kind for t in a.targets()] == ["allreduce", "partial_reduce", "adpsgd"]
    assert a.initial(Metrics(4, 5.0)) == 0  # small: all-reduce, whatever the spread
    assert a.initial(Metrics(8, 3.0)) == 1
    assert a.initial(Metrics(8, 2.0)) == 2  # (gt: 2 itself is not above 2)
    assert a.initial(AdaptiveStrategy.initial_metrics([1, 1, 1, 0.333])) == 0
    assert AdaptiveStrategy.initial_metrics([1, 1, 1, 0.25]).straggler_ratio == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("rules", "expected"),
    [
        ([{"otherwise": {"kind": "adpsgd"}}, {"when": {"num_workers_lt": 6}, "use": {"kind": "allreduce"}}],
         "strategy.rules[0]: 'otherwise' must be the last rule"),
        ([{"when": {"num_workers_lt": 6}, "use": {"kind": "allreduce"}},
          {"when": {"num_workers_lt": 4}, "use": {"kind": "adpsgd"}}, {"otherwise": {"kind": "adpsgd"}}],
         "strategy.rules[1]: never matches: rule 0 matches first"),
        ([{"when": {"num_workers_lt": 3, "num_workers_ge": 5}, "use": {"kind": "allreduce"}},
          {"otherwise": {"kind": "adpsgd"}}], "strategy.rules[0]: never matches: no num_workers"),
        ([{"when": {"straggler_ratio_gt": 3, "straggler_ratio_lt": 3}, "use": {"kind": "allreduce"}},
          {"otherwise": {"kind": "adpsgd"}}], "strategy.rules[0]: never matches: no straggler_ratio"),
        ([{"when": {"num_workers_lt": 3}, "use": {"kind": "ps"}}, {"otherwise": {"kind": "adpsgd"}}],
         "strategy.rules[0]: kind 'ps' cannot be switched to; allowed: allreduce, partial_reduce, adpsgd"),
        ([{"when": {"num_workers_lt": 3}, "use": {"kind": "partial_reduce", "group_size": 1}},
          {"otherwise": {"kind": "adpsgd"}}], "strategy.rules[0].group_size"),
        ([{"when": {"num_workers_lt": 3}, "use": {"kind": "allreduce"}}], "last rule must be 'otherwise'"),
        ([{"when": {}, "use": {"kind": "allreduce"}}, OTHERWISE], "strategy.rules[0].when: bounds no metric"),
        ([{"when": {"num_workers_lt": 3}, "otherwise": {"kind": "allreduce"}}],
         "strategy.rules[0]: give either"),
        ([{"when": {"speed_lt": 3}, "use": {"kind": "allreduce"}}, OTHERWISE],
         "strategy.rules.0.when.speed_lt: unknown key"),
    ],
)  # fmt: skip
def test_a_policy_that_cannot_be_decided_is_refused_naming_the_rule(rules: list, expected: str) -> None:
    with pytest.raises(ValidationError):
        AdaptiveStrategy.model_validate({"rules": rules})
    with pytest.raises(ConfigError) as info:  # as `flotilla validate` says it: one line naming the rule
        load_config(ROOT / "examples/adaptive.yaml", [f"strategy.rules={json.dumps(rules)}"])
    assert expected in str(info.value), str(info.value)
    assert "\n" not in str(info.value) and str(info.value).startswith("strategy.rules"), str(info.value)


def _box(data: st.DataObject) -> tuple[Bound, ...] | None:
    out = []
    for metric, hi_max in (("num_workers", 16), ("straggler_ratio", 5.0)):
        if data.draw(st.booleans()):
            lo = data.draw(st.sampled_from([-math.inf, 0, 1, 2, 3, 4]))
            hi = data.draw(st.sampled_from([math.inf, 1, 2, 3, 5, hi_max]))
            out.append(Bound(metric, float(lo), float(hi), data.draw(st.booleans())))
    return tuple(out) or None


@given(st.data(), st.lists(metrics, min_size=1, max_size=20))
def test_an_accepted_policy_gives_every_snapshot_its_first_matching_rule(
    data: st.DataObject, points: list
) -> None:
    rules = [Rule(_box(data), i) for i in range(data.draw(st.integers(0, 4)))]
    rules = [r for r in rules if r.when is not None] + [Rule(None, 99)]
    try:
        check_rules(rules)
    except PolicyError as exc:
        i = exc.index  # a refusal names a rule that really can never match first
        assert rules[i].when is not None
        return
    for m in points:
        i = first_match(rules, m)
        assert rules[i].holds(m) and not any(r.holds(m) for r in rules[:i])


@given(
    metrics,
    st.integers(0, 3),
    st.integers(0, 10**4),
    st.one_of(st.none(), st.integers(0, 10**4)),
    st.integers(0, 500),
)
def test_hysteresis_no_switch_within_the_dwell_time_and_none_to_the_running_target(
    m: Metrics, running: int, step: int, last: int | None, dwell: int
) -> None:
    rules = AdaptiveStrategy.model_validate(EXAMPLE).policy()
    d = decide(rules, m, running=running, step=step, last_switch_step=last, dwell_steps=dwell)
    assert d == decide(rules, m, running=running, step=step, last_switch_step=last, dwell_steps=dwell)  # pure
    wanted = rules[first_match(rules, m)].target
    if d.target is not None:
        assert d.target == wanted != running
        assert last is None or step - last >= dwell
    else:
        assert wanted == running or (last is not None and step - last < dwell)
    assert f"num_workers={m.num_workers}" in d.why


def test_the_metrics() -> None:
    assert straggler_ratio({0: [1.0, 1.0], 1: [1.0], 2: [3.0, 3.2, 2.8]}) == pytest.approx(3.0)
    assert straggler_ratio({0: [1.0]}) == 1.0
    assert revocation_rate([10.0, 50.0, 95.0], now_s=100.0, window_s=60.0) == pytest.approx(2 * 60.0)
    with pytest.raises(ValueError):
        revocation_rate([], now_s=0.0, window_s=0.0)


def test_the_coordinators_policy_announces_a_switch_once_and_names_its_metrics() -> None:
    from flotilla.sync.adaptive import AdaptiveService
    from flotilla.sync.spec import JobSnapshot, ServiceFacts

    snaps: list[JobSnapshot] = []
    announced: list[int] = []

    def announce(option: int) -> int:
        announced.append(option)
        return max(snaps[-1].steps.values()) + 5

    facts = ServiceFacts(
        num_workers=3, now=lambda: 0.0, stopped=lambda: True, speeds=(1.0, 1.0, 1.0),
        snapshot=lambda: snaps[-1], announce=announce,
    )  # fmt: skip
    settings = AdaptiveStrategy.model_validate({**EXAMPLE, "dwell_steps": 20})
    service = AdaptiveService(settings, facts, start=False)
    assert service.running == 0  # 3 even workers: all-reduce

    def look(live: int, step: int, slow: float = 1.0) -> None:
        snaps.append(JobSnapshot(
            now_s=float(step), live=tuple(range(live)), steps=dict.fromkeys(range(live), step),
            compute_s={w: (slow if w == 0 else 1.0) for w in range(live)},
        ))  # fmt: skip
        service.tick()

    look(3, 10)
    assert announced == []
    look(8, 20)  # grown, even: AD-PSGD (option 1 + its target index 2)
    assert announced == [3] and service.running == 2
    look(8, 30, slow=3.0)  # a 3x straggler: partial reduce, but the dwell time (20 from step 25) holds
    assert announced == [3]
    look(8, 45, slow=3.0)
    assert announced == [3, 2] and service.running == 1
    switches = service.stats()["switches"]
    assert [(s["from"], s["to"]) for s in switches] == [("allreduce", "adpsgd"), ("adpsgd", "partial_reduce")]
    assert switches[1]["straggler_ratio"] == pytest.approx(3.0) and switches[1]["num_workers"] == 8
    assert set(service.handlers()) >= {"pr_ready", "adpsgd_status"}  # every target's service


def test_the_policy_waits_for_every_live_workers_first_time_per_unit() -> None:
    """A 3x straggler configured: the job starts under the target for an uneven cluster; until
    the straggler's first unit is measured the others' times say "even" -- the policy must not
    switch away on that (it did: adpsgd -> diloco at step 2 and back at step 85, measured in the
    heterogeneity benchmark).  A worker that never reports stops holding it after the grace."""
    from flotilla.sync.adaptive import UNMEASURED_GRACE_S, AdaptiveService
    from flotilla.sync.spec import JobSnapshot, ServiceFacts

    snaps: list[JobSnapshot] = []
    announced: list[int] = []
    facts = ServiceFacts(
        num_workers=4, now=lambda: 0.0, stopped=lambda: True, speeds=(1.0, 1.0, 1.0, 1 / 3),
        snapshot=lambda: snaps[-1], announce=lambda option: announced.append(option) or 100,
    )  # fmt: skip
    rules = {"rules": [{"when": {"straggler_ratio_gt": 2}, "use": {"kind": "adpsgd"}},
                       {"otherwise": {"kind": "allreduce"}}], "dwell_steps": 0}  # fmt: skip
    service = AdaptiveService(
        AdaptiveStrategy.model_validate({"kind": "adaptive", **rules}), facts, start=False
    )
    assert service.running == 0  # the configured spread: AD-PSGD

    def look(now: float, times: dict[int, float]) -> None:
        snaps.append(
            JobSnapshot(now_s=now, live=(0, 1, 2, 3), steps=dict.fromkeys(times, 2), compute_s=times)
        )
        service.tick()

    look(1.0, {0: 1.0, 1: 1.0, 2: 1.0})  # the straggler (3) has no time yet: hold
    assert announced == []
    look(2.0, {0: 1.0, 1: 1.0, 2: 1.0, 3: 3.0})  # measured: uneven, AD-PSGD stays
    assert announced == []
    look(2.0 + UNMEASURED_GRACE_S, {0: 1.0, 1: 1.0, 2: 1.0})  # (3 stopped reporting: decided without it)
    assert announced == [2]  # all-reduce (option 1 + target 1)


def test_options_start_with_the_policys_choice_for_the_configured_cluster() -> None:
    from flotilla.sync.adaptive import SPEC
    from flotilla.sync.spec import RunFacts

    settings = AdaptiveStrategy.model_validate(EXAMPLE)
    small = SPEC.options(settings, RunFacts(num_workers=4, batch_size=64, speeds=(1, 1, 1, 1)))  # type: ignore[misc]
    uneven = SPEC.options(settings, RunFacts(num_workers=8, batch_size=64, speeds=(1,) * 7 + (0.25,)))  # type: ignore[misc]
    assert [s.kind for s in small] == ["allreduce", "allreduce", "partial_reduce", "adpsgd"]
    assert [s.kind for s in uneven][0] == "partial_reduce"


def test_the_report_finds_the_switches_in_the_records() -> None:
    from flotilla.report.plots import strategy_switches

    recs = [
        {"time_s": 1.0, "worker_id": 0, "strategy": "allreduce"},
        {"time_s": 1.1, "worker_id": 1, "strategy": "allreduce"},
        {"time_s": 5.2, "worker_id": 1, "strategy": "adpsgd"},
        {"time_s": 5.0, "worker_id": 0, "strategy": "adpsgd"},
        {"time_s": 9.0, "worker_id": 0, "strategy": "allreduce"},
        {"time_s": 9.5, "worker_id": 1, "strategy": "allreduce"},
        {"time_s": 9.6, "worker_id": 2, "strategy": "allreduce"},  # (a joiner: no switch of its own)
        {"time_s": 9.7, "worker_id": 3},  # (an older record without the field)
    ]
    assert strategy_switches(recs, t0=1.0) == [(4.0, "allreduce -> adpsgd"), (8.0, "adpsgd -> allreduce")]
