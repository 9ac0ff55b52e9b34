"""Revocation schedules: trace parsing and replay, the random rate, explicit events, the one sorted
plan, and the ``cluster.revocations`` config section (errors name the field, and the line of a
trace file)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml

from flotilla.cluster.revocation_trace import (
    SlotChange,
    TraceAction,
    TraceError,
    TraceReplay,
    initial_nodes,
    parse_trace,
    replay_trace,
)
from flotilla.cluster.revocations import (
    Action,
    RandomRevocations,
    RevocationAction,
    RevocationError,
    RevocationSchedule,
    check_events,
    plan_revocations,
)
from flotilla.config import load_config, validate_config
from flotilla.config.revocations import resolve_trace_path
from flotilla.core.errors import ConfigError

TRACES = Path(__file__).resolve().parents[2] / "examples" / "traces"
P3, G4DN = TRACES / "aws-p3-spot.csv", TRACES / "aws-g4dn-spot.csv"
W4 = ("w0", "w1", "w2", "w3")


def kill(worker: str, at: float | int, **kw: float) -> RevocationAction:
    """A kill at ``at`` seconds (a float) or at step ``at`` (an int)."""
    when = {"at_s": at} if isinstance(at, float) else {"at_step": at}
    return RevocationAction(action=Action.KILL, worker=worker, **when, **kw)  # type: ignore[arg-type]


def add(worker: str, at: float | int) -> RevocationAction:
    when = {"at_s": at} if isinstance(at, float) else {"at_step": at}
    return RevocationAction(action=Action.ADD, worker=worker, **when)  # type: ignore[arg-type]


def alive_counts(plan: Sequence[RevocationAction], workers: Sequence[str]) -> list[int]:
    """The number of workers alive after each timed action, replaying the plan in order (and
    checking that every kill finds its worker alive and every add finds it dead)."""
    alive, counts = set(workers), []
    for action in plan:
        if action.action is Action.KILL:
            assert action.worker in alive, action
            alive.remove(action.worker)
        elif action.action is Action.ADD:
            assert action.worker not in alive, action
            alive.add(action.worker)
        counts.append(len(alive))
    return counts


# ------------------------------------------------------------------------------------- traces


def test_both_real_traces_parse() -> None:
    p3 = parse_trace(P3.read_text(), source=P3.name)
    g4dn = parse_trace(G4DN.read_text(), source=G4DN.name)
    assert len(p3) == 344  # the README once said 343: the file has 344 lines, each an event
    assert len(g4dn) == 153
    assert sum(e.action is TraceAction.ADD for e in p3) == 177
    assert sum(e.action is TraceAction.ADD for e in g4dn) == 79
    assert (p3[0].time_ms, p3[0].action, p3[0].node, p3[0].line) == (0, TraceAction.ADD, "node1", 1)
    assert (p3[-1].time_ms, p3[-1].node, p3[-1].line) == (40_920_000, "node172", 344)
    assert g4dn[0].time_ms == 480_000


def test_real_traces_replay_within_the_cap() -> None:
    replay = TraceReplay(events=parse_trace(P3.read_text()), time_scale=600, max_workers=4)
    assert initial_nodes(replay) == ("node1", "node2", "node3", "node4")
    plan = plan_revocations(RevocationSchedule(trace=replay), W4)
    assert plan and all(a.action in (Action.KILL, Action.ADD) and a.timed for a in plan)
    assert max(alive_counts(plan, W4)) <= 4
    assert max(a.at_s or 0.0 for a in plan) <= 40_920 / 600
    late = TraceReplay(events=parse_trace(G4DN.read_text()), time_scale=60, max_workers=2, start_ms=600_000)
    assert len(initial_nodes(late)) == 2
    assert max(alive_counts(plan_revocations(RevocationSchedule(trace=late), ("a", "b")), ("a", "b"))) <= 2


def test_time_scale_and_start_ms() -> None:
    text = "0,add,nodeA\n0,add,nodeB\n60000,remove,nodeA\n120000,add,nodeC\n"
    events = parse_trace(text)
    plan = replay_trace(TraceReplay(events=events, time_scale=60, max_workers=2), ["w0", "w1"])
    assert plan == (
        SlotChange(at_s=1.0, action=TraceAction.REMOVE, worker="w0", line=3),
        SlotChange(at_s=2.0, action=TraceAction.ADD, worker="w0", line=4),  # the freed slot
    )
    shifted = replay_trace(
        TraceReplay(events=events, time_scale=1, max_workers=2, start_ms=30_000), ["w0", "w1"]
    )
    assert [c.at_s for c in shifted] == [30.0, 90.0]
    folded = TraceReplay(events=events, max_workers=2, start_ms=60_000)  # the remove is folded
    assert initial_nodes(folded) == ("nodeB",)
    assert replay_trace(folded, ["w0"]) == (
        SlotChange(at_s=60.0, action=TraceAction.ADD, worker="spot-0", line=4),
    )


def test_cap_skips_adds_and_ignores_their_removes() -> None:
    over = TraceReplay(events=parse_trace("0,add,n1\n0,add,n2\n0,add,n3\n"), max_workers=2)
    assert initial_nodes(over) == ("n1", "n2")  # n3 is over the cap at the start
    text = "\n".join(
        [
            "0,add,n1",
            "0,add,n2",
            "1000,add,n4",  # slot spot-0 (max_workers 3)
            "2000,add,n5",  # all 3 slots busy: skipped
            "3000,remove,n5",  # not running: ignored
            "3000,remove,n9",  # never added: ignored
            "4000,remove,n1",  # frees w0
            "5000,add,n6",  # lowest free slot: w0 restarts
            "6000,add,n6",  # already running: ignored
            "6500,remove,n2",  # frees w1
            "7000,add,n7",
            "7000,remove,n7",  # same millisecond: leaves no trace
            "8000,add,n8",  # w1 restarts
            "# a comment",
            "",
        ]
    )
    changes = replay_trace(TraceReplay(events=parse_trace(text), max_workers=3), ["w0", "w1"])
    assert [(c.at_s, c.action.value, c.worker, c.line) for c in changes] == [
        (1.0, "add", "spot-0", 3),
        (4.0, "remove", "w0", 7),
        (5.0, "add", "w0", 8),
        (6.5, "remove", "w1", 10),
        (8.0, "add", "w1", 13),
    ]


def test_trace_refuses_a_worker_count_mismatch() -> None:
    events = parse_trace(P3.read_text())
    with pytest.raises(
        TraceError, match="the trace has 4 nodes alive at start_ms=0 .* but 3 are given"
    ) as info:
        replay_trace(TraceReplay(events=events, max_workers=4), ["w0", "w1", "w2"])
    assert info.value.field == "max_workers"
    with pytest.raises(
        TraceError, match=r"no node is alive at start_ms=0 \(the first add is at 480000 ms on line 1\)"
    ):
        replay_trace(TraceReplay(events=parse_trace(G4DN.read_text()), max_workers=4), ["w0"])
    small = parse_trace("0,add,a\n5,add,b\n")
    with pytest.raises(TraceError, match=r"\['spot-0'\] already name other workers"):
        replay_trace(TraceReplay(events=small, max_workers=2), ["w0"], taken={"spot-0"})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0,add,n1\n5,explode,n1\n", "t.csv:2: unknown action 'explode'; allowed: add, remove"),
        ("0,add,n1\nhello\n", "t.csv:2: expected time_ms,add|remove,node (got 'hello')"),
        ("0,add,n1,extra\n", "t.csv:1: expected time_ms,add|remove,node"),
        ("-5,add,n1\n", "t.csv:1: time_ms must be a whole number of milliseconds >= 0 (got '-5')"),
        ("1.5,add,n1\n", "t.csv:1: time_ms must be a whole number"),
        ("0,add,\n", "t.csv:1: node must be 1-64 letters"),
        (
            "10,add,n1\n\n5,add,n2\n",
            "t.csv:3: time 5 ms is before 10 ms on line 1 (times must be non-decreasing)",
        ),
        ("", "t.csv: no events (expected lines time_ms,add|remove,node)"),
        ("# only a comment\n\n", "t.csv: no events"),
    ],
)
def test_bad_trace_text(text: str, expected: str) -> None:
    with pytest.raises(TraceError) as info:
        parse_trace(text, source="t.csv")
    assert str(info.value).startswith(expected)


# ------------------------------------------------------------------------------------- random


def random_plan(
    seed: int, *, min_alive: int = 1, workers: Sequence[str] = W4
) -> tuple[RevocationAction, ...]:
    rnd = RandomRevocations(mean_interval_s=2.0, seed=seed, respawn_after_s=3.0, min_alive=min_alive)
    return plan_revocations(RevocationSchedule(random=rnd), workers, horizon_s=100.0)


def test_random_is_deterministic_under_a_seed() -> None:
    assert random_plan(7) == random_plan(7)
    assert random_plan(7) != random_plan(8)
    plan = random_plan(7)
    assert plan == tuple(sorted(plan, key=RevocationAction.sort_key))
    assert all(a.at_s is not None and 0 < a.at_s <= 100.0 for a in plan)
    respawns = {(a.worker, round(a.at_s or 0, 9)) for a in plan if a.action is Action.ADD}
    assert respawns <= {(a.worker, round((a.at_s or 0) + 3.0, 9)) for a in plan if a.action is Action.KILL}


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("min_alive", [1, 2, 3])
def test_random_never_goes_below_min_alive(seed: int, min_alive: int) -> None:
    plan = random_plan(seed, min_alive=min_alive)
    assert any(a.action is Action.KILL for a in plan)
    assert min(alive_counts(plan, W4)) >= min_alive


def test_random_window_no_respawn_and_scripted_workers() -> None:
    rnd = RandomRevocations(
        mean_interval_s=1.0, seed=1, respawn_after_s=None, start_s=10, stop_s=20, min_alive=1
    )
    schedule = RevocationSchedule(random=rnd, events=(kill("w3", 50.0),))
    plan = plan_revocations(schedule, W4)
    randoms = [a for a in plan if a.worker != "w3"]
    assert all(a.action is Action.KILL and 10 < (a.at_s or 0) <= 20 for a in randoms)
    assert sorted(a.worker for a in randoms) == ["w0", "w1", "w2"]  # w3 alive keeps min_alive
    assert kill("w3", 50.0) in plan  # w3 is scripted: random never picks it
    assert plan_revocations(schedule, W4, horizon_s=30) == tuple(randoms)
    with pytest.raises(ValueError, match="need random.stop_s or a horizon_s"):
        plan_revocations(RevocationSchedule(random=RandomRevocations(mean_interval_s=1.0)), W4)


# ------------------------------------------------------------------------------ events, plans


def test_plan_sorts_timed_then_steps_kills_before_adds() -> None:
    events = (
        add("w1", 5.0),
        kill("w1", 5.0),
        kill("w2", 3),
        add("new", 1),
        RevocationAction(action=Action.STOP, worker="w0", at_s=1.0, duration_s=2.0),
        kill("w3", 0.5, notice_s=1.0),
        add("w3", 1.5),
    )
    plan = plan_revocations(RevocationSchedule(events=events), W4)
    assert [(a.when, a.action.value, a.worker) for a in plan] == [
        ("0.5 s", "kill", "w3"),
        ("1 s", "stop", "w0"),
        ("1.5 s", "add", "w3"),
        ("5 s", "kill", "w1"),
        ("5 s", "add", "w1"),
        ("step 1", "add", "new"),
        ("step 3", "kill", "w2"),
    ]
    assert (
        plan_revocations(RevocationSchedule(events=events), W4, horizon_s=1.0, horizon_steps=2)
        == plan[:2] + plan[5:6]
    )


@pytest.mark.parametrize(
    ("events", "where", "fragment"),
    [
        ((kill("x", 1.0),), "events.0.worker", "unknown worker 'x'; allowed: w0, w1, w2, w3 or a worker"),
        (
            (kill("w1", 1.0), kill("w1", 2.0)),
            "events.1.worker",
            "'w1' is not alive at 2 s (event 0 killed it at 1 s)",
        ),
        (
            (kill("new", 1.0), add("new", 2.0)),
            "events.0.worker",
            "'new' is not alive at 1 s (it has not been added yet)",
        ),
        ((add("w0", 1.0),), "events.0.worker", "'w0' is already alive at 1 s; add starts a new worker"),
        ((kill("w0", 1.0, notice_s=5.0), add("w0", 3.0)), "events.1.at_s", "still leaving until 6 s"),
        ((kill("w0", 1.0), add("w0", 4)), "events.1.at_step", "has events at_s and at_step (event 0)"),
        (
            (kill("w2", 4), kill("w2", 2)),
            "events.0.worker",
            "'w2' is not alive at step 4 (event 1 killed it at step 2)",
        ),
        (
            (
                RevocationAction(action=Action.STOP, worker="w0", at_s=1.0, duration_s=5.0),
                RevocationAction(action=Action.STOP, worker="w0", at_s=2.0, duration_s=1.0),
            ),
            "events.1.at_s",
            "already stopped until 6 s",
        ),
    ],
)
def test_bad_events(events: tuple[RevocationAction, ...], where: str, fragment: str) -> None:
    with pytest.raises(RevocationError) as info:
        check_events(events, W4)
    assert info.value.where == where
    assert fragment in str(info.value)


def test_actions_refuse_impossible_fields() -> None:
    with pytest.raises(ValueError, match="exactly one of at_s, at_step"):
        RevocationAction(action=Action.KILL, worker="w0")
    with pytest.raises(ValueError, match="notice_s must be > 0 and only on a kill"):
        RevocationAction(action=Action.ADD, worker="w0", at_s=1.0, notice_s=1.0)
    with pytest.raises(ValueError, match="a stop, and only a stop, takes duration_s"):
        RevocationAction(action=Action.STOP, worker="w0", at_s=1.0)
    with pytest.raises(RevocationError, match="set random or trace, not both"):
        RevocationSchedule(
            random=RandomRevocations(mean_interval_s=1.0),
            trace=TraceReplay(events=parse_trace("0,add,a"), max_workers=1),
        )


# --------------------------------------------------------------------------------- the config


def run_yaml(revocations: str, *, num_workers: int = 4) -> str:
    return (
        f"cluster:\n  num_workers: {num_workers}\n  revocations:\n"
        + "".join(f"    {line}\n" for line in revocations.strip().splitlines())
        + "job: {model: {name: mlp}, dataset: {name: synthetic}, steps: 5}\n"
    )


def config_error(revocations: str, *, num_workers: int = 4) -> str:
    """The one-line message of the ConfigError raised by loading (as in test_config.py)."""
    with pytest.raises(ConfigError) as info:
        load_config(text=run_yaml(revocations, num_workers=num_workers))
    message = str(info.value)
    assert "\n" not in message and info.value.__cause__ is None
    return message


def test_yaml_round_trip(tmp_path: Path) -> None:
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "p3.csv").write_text(P3.read_text())
    text = run_yaml(
        """
events:
  - {at_s: 1.5, action: kill, worker: extra, notice_s: 2}
  - {at_step: 3, action: stop, worker: w0, duration_s: 0.5}
  - {at_s: 0.5, action: add, worker: extra}
trace: {file: traces/p3.csv, time_scale: 600, max_workers: 3}
"""
    )
    path = tmp_path / "run.yaml"
    path.write_text(text)
    data = resolve_trace_path(yaml.safe_load(path.read_text()), str(tmp_path))
    assert data["cluster"]["revocations"]["trace"]["file"] == str(tmp_path / "traces" / "p3.csv")
    cfg = validate_config(data)
    section = cfg.cluster.revocations
    assert [e.action for e in section.events] == ["kill", "stop", "add"]
    assert section.trace is not None and len(section.trace.replay().events) == 344
    assert validate_config(json.loads(json.dumps(cfg.to_dict()))) == cfg
    plan = section.plan([w.name for w in cfg.cluster.resolved_workers()])
    assert plan[:2] == (add("extra", 0.5), kill("extra", 1.5, notice_s=2.0))
    assert plan[-1] == RevocationAction(action=Action.STOP, worker="w0", at_step=3, duration_s=0.5)
    # w0 is scripted, so the trace drives w1..w3 and its extra slot is never needed beyond max_workers
    assert {a.worker for a in plan if a.timed} <= {"extra", "w1", "w2", "w3"}
    absolute = text.replace("traces/p3.csv", str(tmp_path / "traces" / "p3.csv"))
    path.write_text(absolute)
    assert load_config(path) == cfg


def test_resolve_trace_path_leaves_absolute_and_missing_alone(tmp_path: Path) -> None:
    data = {"cluster": {"revocations": {"trace": {"file": "nowhere.csv"}}}}
    assert resolve_trace_path(data, str(tmp_path)) == data
    absolute = {"cluster": {"revocations": {"trace": {"file": str(P3)}}}}
    assert resolve_trace_path(absolute, "/") == absolute
    assert resolve_trace_path({"cluster": {"num_workers": 2}}, str(tmp_path)) == {
        "cluster": {"num_workers": 2}
    }


@pytest.mark.parametrize(
    ("revocations", "expected"),
    [
        (
            "events: [{at_s: 1, action: kill, worker: nobody}]",
            "cluster.revocations.events.0.worker: unknown worker 'nobody'; allowed: w0, w1, w2, w3 "
            "or a worker that an add event starts",
        ),
        (
            "events: [{at_s: -1, action: kill, worker: w0}]",
            "cluster.revocations.events.0.at_s: must be >= 0 (got -1)",
        ),
        (
            "events: [{at_step: -2, action: kill, worker: w0}]",
            "cluster.revocations.events.0.at_step: must be >= 0 (got -2)",
        ),
        (
            "events: [{at_s: 1, at_step: 2, action: kill, worker: w0}]",
            "cluster.revocations.events.0.at_s: set exactly one of at_s (seconds), at_step (steps) "
            "(got both)",
        ),
        (
            "events: [{action: kill, worker: w0}]",
            "cluster.revocations.events.0.at_s: set exactly one of at_s (seconds), at_step (steps) "
            "(got neither)",
        ),
        (
            "events: [{at_s: 1, action: stop, worker: w0, duration_s: 1, notice_s: 3}]",
            "cluster.revocations.events.0.notice_s: only a kill takes notice_s (this event is a stop)",
        ),
        (
            "events: [{at_s: 1, action: add, worker: w9, notice_s: 3}]",
            "cluster.revocations.events.0.notice_s: only a kill takes notice_s (this event is an add)",
        ),
        (
            "events: [{at_s: 1, action: kill, worker: w0, duration_s: 3}]",
            "cluster.revocations.events.0.duration_s: only a stop takes duration_s (this event is a kill)",
        ),
        (
            "events: [{at_s: 1, action: stop, worker: w0}]",
            "cluster.revocations.events.0.duration_s: a stop needs duration_s (seconds until SIGCONT)",
        ),
        (
            "events: [{at_s: 1, action: kill, worker: w0, notice_s: 0}]",
            "cluster.revocations.events.0.notice_s: must be > 0",
        ),
        (
            "events: [{at_s: 1, action: explode, worker: w0}]",
            "cluster.revocations.events.0.action: unknown 'explode'; allowed: kill, stop, add",
        ),
        (
            "events: [{at_s: 1, worker: w0}]",
            "cluster.revocations.events.0.action: missing (required); allowed: kill, stop, add",
        ),
        (
            "events: [{at_s: 1, action: kill, worker: w1}, {at_s: 2, action: kill, worker: w1}]",
            "cluster.revocations.events.1.worker: worker 'w1' is not alive at 2 s "
            "(event 0 killed it at 1 s); cannot kill it",
        ),
        (
            "random: {mean_interval_s: 5, respawn_after_s: null, min_alive: 4}",
            "cluster.revocations.random.min_alive: must be < the number of workers (4), "
            "or no worker can ever be killed (got 4)",
        ),
        (
            "random: {mean_interval_s: 5, respawn_after_s: 1, start_s: 10, stop_s: 5}",
            "cluster.revocations.random.stop_s: must be > start_s (10) (got 5)",
        ),
        ("random: {mean_interval_s: 5}", "cluster.revocations.random.respawn_after_s: missing (required)"),
        (
            "random: {mean_interval_s: 0, respawn_after_s: 1}",
            "cluster.revocations.random.mean_interval_s: must be > 0",
        ),
        (
            "trace: {file: nowhere.csv, max_workers: 2}",
            "cluster.revocations.trace.file: no such trace file 'nowhere.csv'",
        ),
        (
            "bogus: 1",
            "cluster.revocations.bogus: unknown key; allowed: events, random, time_from_step, trace",
        ),
    ],
)
def test_config_errors(revocations: str, expected: str) -> None:
    assert config_error(revocations).startswith(expected)


def test_config_random_and_trace_exclude_each_other() -> None:
    text = f"random: {{mean_interval_s: 5, respawn_after_s: 1}}\ntrace: {{file: {P3}, max_workers: 4}}"
    assert config_error(text) == (
        "cluster.revocations.random: set random or trace, not both: both drive the workers "
        "that no event names (combine either with events)"
    )


def test_config_every_worker_scripted_leaves_random_nothing() -> None:
    events = ", ".join(f"{{at_s: 1, action: stop, worker: w{i}, duration_s: 1}}" for i in range(2))
    message = config_error(
        f"events: [{events}]\nrandom: {{mean_interval_s: 5, respawn_after_s: 1}}", num_workers=2
    )
    assert message.startswith("cluster.revocations.random: every worker is named by an event")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("0,add,n1\n0,add,n2\n5,explode,n1\n", ":3: unknown action 'explode'; allowed: add, remove"),
        ("0,add,n1\nnot a line\n", ":2: expected time_ms,add|remove,node (got 'not a line')"),
        ("10,add,n1\n5,add,n2\n", ":2: time 5 ms is before 10 ms on line 1 (times must be non-decreasing)"),
        ("\n", ": no events"),
    ],
)
def test_config_bad_trace_file_names_the_line(tmp_path: Path, content: str, expected: str) -> None:
    trace = tmp_path / "bad.csv"
    trace.write_text(content)
    message = config_error(f"trace: {{file: {trace}, max_workers: 2}}", num_workers=2)
    assert message.startswith(f"cluster.revocations.trace.file: {trace}{expected}")


def test_config_trace_count_mismatch() -> None:
    message = config_error(f"trace: {{file: {P3}, max_workers: 3}}", num_workers=2)
    assert message.startswith(
        "cluster.revocations.trace.max_workers: the trace has 3 nodes alive at start_ms=0 "
        "(at most max_workers=3), so it starts 3 workers, but 2 are given (w0, w1)"
    )
    message = config_error(f"trace: {{file: {G4DN}, max_workers: 2}}", num_workers=2)
    assert message.startswith("cluster.revocations.trace.start_ms: no node is alive at start_ms=0")


def test_config_without_revocations_plans_nothing() -> None:
    cfg = load_config(text=run_yaml("events: []"))
    assert cfg.cluster.revocations.plan(["w0", "w1", "w2", "w3"]) == ()


# ---------------------------------------------------------------------------------------- purity


def test_pure_modules_load_nothing_impure() -> None:
    code = (
        "import json, sys\n"
        "import flotilla.cluster.revocations, flotilla.cluster.revocation_trace\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    impure = ("torch", "zmq", "threading", "socket", "multiprocessing", "subprocess", "asyncio")
    assert not sorted(m for m in loaded if m.split(".")[0] in impure)
    src = Path(__file__).resolve().parents[2] / "src" / "flotilla" / "cluster"
    for name in ("revocations.py", "revocation_trace.py"):
        assert "open(" not in (src / name).read_text()
