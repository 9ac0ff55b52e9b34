"""The adaptive strategy in virtual time (``sim/adaptive.py``, ``sim/adaptive_view.py``): segments
simulated by each target's own hook, the runtime's pure policy deciding when to switch.

Checked: without a change the result is the chosen target's own simulation; a revocation below a
threshold switches at the first look after the coordinator sees it, and what follows is exactly the
second target's simulation on the survivors; the dwell holds a second switch; replacing the policy
(a ``decide`` that never switches, or the rules swapped) changes the prediction, so the policy is
called, not copied; the switch's cost terms; ``flotilla simulate`` of the example."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flotilla.cli.main import app
from flotilla.cluster import adaptive_policy
from flotilla.cluster.comm_cost import ring_allreduce_s, transfer_s
from flotilla.sim.adaptive import AdaptiveSpec, Switch, Target, adaptive_of, simulate_adaptive, switch_terms
from flotilla.sim.adaptive_view import Coordinator, PolicySpec
from flotilla.sim.adpsgd import ADPSGDSpec
from flotilla.sim.model import Change, DeviceClass, Recovery, SimCluster, SimJob, SimResult
from flotilla.sim.pr_spec import PRSpec
from flotilla.sim.vote import VoteSpec
from flotilla.sync import registry

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "flotilla"
FOUR = SimCluster(classes=(DeviceClass(type="V100", count=4, per_node=4, price_per_hour=2.0),))
THREE = SimCluster(classes=(DeviceClass(type="V100", count=3, per_node=4, price_per_hour=2.0),))
JOB = SimJob(steps=300, step_s=0.1, model_bytes=4_000_000, batch_per_worker=8)
REC = Recovery(detect_s=0.2, repair_s=0.05, startup_s=1.0)
KILL = [Change(5.0, True, "V100-3")]  # (detected at 5.2: the policy's next look, every 0.5 s, is 5.5)
BACK = [*KILL, Change(6.0, False, "V100-3")]  # (joins at 7.0, measured after its first step)
FEW_ADPSGD = [
    {"when": {"num_workers_lt": 4}, "use": {"kind": "adpsgd"}},
    {"otherwise": {"kind": "allreduce"}},
]
FEW_ALLREDUCE = [
    {"when": {"num_workers_lt": 4}, "use": {"kind": "allreduce"}},
    {"otherwise": {"kind": "adpsgd"}},
]


def spec_of(rules: list[dict] = FEW_ADPSGD, dwell_steps: int = 20) -> AdaptiveSpec:
    section = {"kind": "adaptive", "rules": rules, "dwell_steps": dwell_steps, "every_s": 0.5}
    return adaptive_of(registry.settings_of(section))


def run(spec: AdaptiveSpec, changes: list[Change]) -> tuple[SimResult, list[Switch]]:
    switches: list[Switch] = []
    return simulate_adaptive(JOB, FOUR, spec, changes=changes, recovery=REC, record=switches), switches


def same(a: SimResult, b: SimResult) -> bool:
    fields = ("steps", "time_s", "completed", "samples", "timeline", "recoveries_s", "device_s", "cost")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


@pytest.mark.parametrize(("rules", "kind"), [(FEW_ADPSGD, "allreduce"), (FEW_ALLREDUCE, "adpsgd")])
def test_without_a_change_it_is_the_chosen_targets_own_simulation(rules: list[dict], kind: str) -> None:
    spec = spec_of(rules)
    target = next(t for t in spec.targets if t.kind == kind)  # (4 workers: the 'otherwise' rule)
    r, switches = run(spec, [])
    own = target.sim.simulate(JOB, FOUR, changes=[], recovery=REC)
    assert not switches and r.strategy == "adaptive" and r.note.startswith(f"{kind} throughout")
    assert same(r, own) and r.steps == 300 and r.completed


def test_a_revocation_below_the_threshold_switches_and_the_rest_is_the_second_targets_run() -> None:
    r, switches = run(spec_of(), KILL)
    [sw] = switches
    assert (sw.came, sw.went, sw.num_workers, sw.rule) == ("allreduce", "adpsgd", 3, 0)
    assert sw.decided_s == 5.5  # the first look after the coordinator declared the worker dead
    before = VoteSpec().simulate(JOB, FOUR, changes=KILL, recovery=REC)
    step_then = max(s for t, s, _ in before.timeline if t <= 5.5)
    assert sw.announced_step == sw.step > step_then + 1  # (announce_step's lead: beyond every worker)
    assert f"allreduce -> adpsgd at step {sw.step} (t={sw.at_s:.1f} s, 3 workers" in r.note
    assert sw.terms == () and sw.start_s == sw.at_s  # (into AD-PSGD nothing is exchanged)
    # up to the switch: the all-reduce's own run; after it: AD-PSGD's on the three survivors
    head = [e for e in r.timeline if e[1] <= sw.step]
    assert head == [e for e in before.timeline if e[1] <= sw.step] and head[-1][0] == sw.at_s
    rest = ADPSGDSpec().simulate(dataclasses.replace(JOB, steps=300 - sw.step), THREE, recovery=REC)
    assert r.timeline[len(head) :] == [(sw.start_s + t, sw.step + s, n) for t, s, n in rest.timeline]
    assert r.time_s == pytest.approx(sw.start_s + rest.time_s, rel=1e-12)
    assert r.steps == 300 and r.completed and r.time_s != before.time_s
    per_step_before = (head[-1][0] - head[-11][0]) / 10
    per_step_after = (r.timeline[-1][0] - r.timeline[-11][0]) / 10
    assert per_step_after != pytest.approx(per_step_before, rel=1e-3)  # (another strategy's pace)
    # the devices: 4 until the revocation, then 3 until the end
    assert r.device_s == pytest.approx(4 * 5.0 + 3 * (r.time_s - 5.0)) and r.cost == pytest.approx(
        r.device_s / 3600 * 2.0
    )


def test_the_dwell_holds_a_second_switch_until_its_steps_passed() -> None:
    held, [first] = run(spec_of(dwell_steps=10**6), BACK)  # (the worker is back: 4 again, held)
    assert "adpsgd -> allreduce" not in held.note and first.went == "adpsgd"
    decided = []
    for dwell in (0, 20, 60):
        r, switches = run(spec_of(dwell_steps=dwell), BACK)
        assert [(s.came, s.went) for s in switches] == [("allreduce", "adpsgd"), ("adpsgd", "allreduce")]
        one, two = switches
        assert one == first and two.num_workers == 4
        reported = [s for t, s, _ in r.timeline if t <= two.decided_s][-1]
        assert reported - one.announced_step >= dwell  # the runtime's rule: steps since the last switch
        before = [s for t, s, _ in r.timeline if t <= two.decided_s - 0.5][-1]
        assert dwell == 0 or before - one.announced_step < dwell  # ... and the look before was held
        assert r.steps == 300 and r.completed
        times, steps = [e[0] for e in r.timeline], [e[1] for e in r.timeline]
        assert times == sorted(times) and steps == sorted(steps)
        decided.append(two.decided_s)
    # without a dwell: the first look after the newcomer joined (7.0) and reported its first step
    assert decided[0] == 7.5 and decided[0] < decided[1] < decided[2]


def test_a_switch_into_a_vote_pays_the_group_the_average_and_the_state() -> None:
    _, [_, back] = run(spec_of(), BACK)
    link, m = FOUR.intra_node, JOB.model_bytes
    state = ring_allreduce_s(4, 4, link) + transfer_s(8, link) + transfer_s(0, link) + transfer_s(2 * m, link)
    expected = {
        "group": REC.repair_s,
        "probe": ring_allreduce_s(4, 32, link),
        "average": ring_allreduce_s(4, m, link),
        "state": state,
    }
    assert dict(back.terms) == pytest.approx(expected)
    assert back.start_s == pytest.approx(back.at_s + sum(expected.values()))
    pr = Target("partial_reduce", PRSpec(group_size=2))
    ar, ad = Target("allreduce", VoteSpec()), Target("adpsgd", ADPSGDSpec())
    dl = Target("diloco", VoteSpec(name="diloco", inner_steps=5))
    devices = list(FOUR.devices())

    def terms(came: Target, went: Target) -> dict[str, float]:
        return switch_terms(came, went, JOB, FOUR, devices, REC)

    assert terms(pr, ad) == {"pr_leave": 2 * FOUR.message_s(256, devices)}  # (leaving the controller)
    assert set(terms(pr, ar)) == {"pr_leave", "group", "probe", "average", "state"}
    assert set(terms(ar, dl)) == {"probe", "state"}  # (a vote to a vote: the group held, replicas equal)
    assert terms(ar, ad) == terms(dl, pr) == {}


def test_the_policy_is_the_runtimes_pure_function(monkeypatch: pytest.MonkeyPatch) -> None:
    adaptive, [_] = run(spec_of(), KILL)
    calls: list[dict] = []
    real = adaptive_policy.decide

    def spy(rules, m, **kw):  # type: ignore[no-untyped-def]
        calls.append({"metrics": m, **kw})
        return real(rules, m, **kw)

    monkeypatch.setattr(adaptive_policy, "decide", spy)
    again, _ = run(spec_of(), KILL)
    assert same(again, adaptive) and calls and calls[-1]["running"] == 0 and calls[-1]["dwell_steps"] == 20
    assert any(c["metrics"].num_workers == 3 for c in calls)
    # a decide that never switches: the all-reduce throughout, the revocation included
    monkeypatch.setattr(
        adaptive_policy, "decide", lambda rules, m, **kw: adaptive_policy.Decision(None, 0, "")
    )
    stays, switches = run(spec_of(), KILL)
    assert not switches and same(stays, VoteSpec().simulate(JOB, FOUR, changes=KILL, recovery=REC))
    assert stays.time_s != adaptive.time_s
    monkeypatch.setattr(adaptive_policy, "decide", real)
    swapped, [sw] = run(spec_of(FEW_ALLREDUCE), KILL)  # (the rules swapped: AD-PSGD first)
    assert (sw.came, sw.went) == ("adpsgd", "allreduce") and swapped.time_s != adaptive.time_s


def test_a_target_without_a_simulated_hook_is_a_value_error_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = registry.spec_of("adpsgd")
    monkeypatch.setitem(registry._SPECS, "adpsgd", dataclasses.replace(spec, simulated=""))
    with pytest.raises(ValueError, match=r"target 1 \(adpsgd\) is not simulated yet"):
        spec_of()
    result = CliRunner().invoke(
        app, ["simulate", str(ROOT / "examples" / "adaptive.yaml"), "--step-s", "0.01"]
    )
    assert (
        result.exit_code == 2 and "error: " in result.output and "(adpsgd) is not simulated" in result.output
    )


def test_bad_specs_are_refused() -> None:
    rule = adaptive_policy.Rule(None, 1)
    with pytest.raises(ValueError, match="AdaptiveSpec.targets"):
        AdaptiveSpec(policy=PolicySpec(rules=(rule,)), targets=(Target("allreduce", VoteSpec()),))
    with pytest.raises(ValueError, match="dwell_steps"):
        PolicySpec(rules=(rule,), dwell_steps=-1)


def test_flotilla_simulate_runs_the_adaptive_example(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    args = ["simulate", str(ROOT / "examples" / "adaptive.yaml"), "--step-s", "0.01", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "not simulated yet" not in result.output
    [line] = [x for x in result.output.splitlines() if x.startswith("adaptive ")]
    assert " done " in line and "allreduce -> adpsgd at step" in line and "5 workers" in line
    assert "adpsgd -> allreduce at step" in line and "3 workers" in line
    [row] = json.loads(out.read_text())["rows"]
    assert row["simulated"] and row["completed"] and row["steps"] == 900


def test_the_coordinators_figures_are_the_runtimes() -> None:
    from flotilla.roles import coordinator, coordinator_switch, link
    from flotilla.sync import adaptive

    c = Coordinator()
    assert (c.lead_s, c.heartbeat_s) == (coordinator.SWITCH_LEAD_S, link.HEARTBEAT_S)
    assert (c.grace_s, c.max_switches) == (adaptive.UNMEASURED_GRACE_S, coordinator_switch.MAX_SWITCHES)
    assert registry.spec_of("adaptive").simulated == "flotilla.sim.adaptive:adaptive_of"


@pytest.mark.parametrize("module", ["flotilla.sim.adaptive", "flotilla.sim.adaptive_view"])
def test_the_modules_are_pure(module: str) -> None:
    path = SRC / (module.removeprefix("flotilla.").replace(".", "/") + ".py")
    tree = ast.parse(path.read_text())
    top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {(n.module or "").split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert not top & {"torch", "threading", "time", "datetime", "socket", "zmq", "subprocess"}
    assert "open(" not in path.read_text()
    code = f"import importlib, json, sys; importlib.import_module({module!r}); "
    code += "print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    loaded = {m.split(".")[0] for m in json.loads(out.stdout.strip().splitlines()[-1])}
    assert not loaded & {"torch", "threading", "zmq", "socket"}, sorted(loaded & {"torch", "threading"})
