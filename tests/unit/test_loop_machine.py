"""The loop machine (``trainer/loop_machine.py``) driven without torch by a fake world.

A fake world answers the machine's queries from a script of unit outcomes drawn by hypothesis
(commit, a broken group, a non-finite value, a discarded vote, a view change, a coordinator stop,
an agreed switch); for a vote (``Regime.VOTE``) every rank gets the same agreed outcome, as the
barrier makes it.  The properties: the step never goes back nor past the total; a unit that did
not commit gets no duties; every rank takes the same decisions; a switch happens at the announced
step on every worker.  ``test_a_thousand_steps_without_torch`` drives every built-in strategy's
terms for 1,000 steps in a fresh interpreter and checks torch was never imported: this is what a
simulator drives.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Generator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flotilla.sync.base import Outcome, Regime, Terms
from flotilla.trainer import loop_events as ev
from flotilla.trainer import loop_machine as lm
from flotilla.trainer.boundary import BoundaryPolicy, SwitchAt


def terms(regime: Regime, k: int = 1, name: str = "", newcomers: bool | None = None) -> Terms:
    return Terms(
        regime=regime, steps_per_commit=k, nominal_batch=False, checks_gradients=False, name=name,
        takes_newcomers=regime.elastic if newcomers is None else newcomers,
    )  # fmt: skip


BUILT_IN = {  # the terms the built-in strategies declare (checked against them below)
    "allreduce": terms(Regime.VOTE, 1, "allreduce"),
    "diloco": terms(Regime.VOTE, 10, "diloco"),
    "partial_reduce": terms(Regime.GROUPS, 1, "partial_reduce", newcomers=True),  # (its first group fills)
    "adpsgd": terms(Regime.ALONE, 1, "adpsgd"),
    "ps": terms(Regime.ALONE, 1, "ps"),
    "ps_wsp": terms(Regime.ALONE, 4, "ps"),
    "pipeline-stage": terms(Regime.GROUPS, 1000, "pipeline-stage"),
}

OUTCOMES = ("commit", "broken", "nonfinite", "discarded", "view", "stop", "switch")


@dataclass
class World:
    """The answers of a fake world to one worker's machine; ``script``: per unit index, what
    happens (missing: commit)."""

    rank: int
    size: int
    options: tuple[Terms, ...]
    script: dict[int, str] = field(default_factory=dict)
    epoch: int = 1
    step: int = 0
    units: int = 0
    trace: list[ev.Effect] = field(default_factory=list)
    steps_seen: list[int] = field(default_factory=list)
    builds: list[tuple[int, int]] = field(default_factory=list)  # (step, option)
    boundaries: list[tuple[ev.UnitDone, list[ev.Effect]]] = field(default_factory=list)
    news: list[tuple[int, SwitchAt]] = field(default_factory=list)  # (known from unit, switch)

    def view(self) -> ev.ViewFacts:
        return ev.ViewFacts(self.epoch, self.rank, self.size)

    def answer(self, e: ev.Effect) -> ev.Event | int:
        match e:
            case ev.AskFirstView():
                return ev.FirstView(self.view(), initial=True, step=0, has_state=True)
            case ev.Restore():
                return ev.Restored(0)
            case ev.Build(option=option):
                self.builds.append((self.step, option))
                return ev.Built(self.options[option])
            case ev.EnterView():
                return ev.Entered(self.step, has_state=True)
            case ev.Recover() | ev.MoveTo():
                self.epoch += 1
                return ev.ViewGiven(self.view()) if isinstance(e, ev.Recover) else ev.Moved(self.view())
            case ev.CatchUp():
                return ev.CaughtUp(self.view())
            case ev.Poll():
                return ev.Polled(announced=tuple(sw for u, sw in self.news if self.units >= u))
            case ev.Exit(code=code):
                return code
            case ev.Finish():
                return 0
            case ev.Refuse(message=message):
                raise AssertionError(message)
        raise AssertionError(f"not a query: {e!r}")

    def drive(self, policy: BoundaryPolicy, limit: int = 100_000) -> Generator[ev.RunUnit, ev.UnitDone, int]:
        """The machine against this world; each unit is yielded and its outcome sent back."""
        state, effects = lm.start(policy, worker=self.rank)
        for _ in range(limit):
            for e in effects[:-1]:
                assert not isinstance(e, ev.Query | ev.End), f"{e!r} before the end of {effects!r}"
                self.trace.append(e)
                if isinstance(e, ev.SetStep):
                    self.step = e.step
                    self.steps_seen.append(e.step)
            last = effects[-1]
            self.trace.append(last)
            if isinstance(last, ev.RunUnit):
                assert last.first_step == self.step and last.last_step >= last.first_step
                answer: ev.Event | int = yield last
                self.units += 1
            else:
                answer = self.answer(last)
            if isinstance(answer, int):
                return answer
            state, effects = lm.step(state, answer)
            if isinstance(answer, ev.UnitDone):  # (the boundary's effects)
                self.boundaries.append((answer, effects))
        raise AssertionError("the machine did not end")

    def run(self, policy: BoundaryPolicy) -> int:
        """Alone: each unit's outcome from the script."""
        gen = self.drive(policy)
        try:
            next(gen)
            while True:
                gen.send(_outcome(self.script.get(self.units, "commit"), self.epoch))
        except StopIteration as stop:
            return int(stop.value)


def lockstep(worlds: list[World], policy: BoundaryPolicy) -> list[int]:
    """Ranks under a vote: every unit's outcome agreed over all ranks' proposals (the MAX)."""
    gens = [w.drive(policy) for w in worlds]
    units = [next(g) for g in gens]
    codes: list[int] = []
    while not codes:
        switch = max(u.proposal.switch for u in units)
        out = ev.UnitDone(Outcome(committed=True, switch=switch))
        nxt = []
        for g in gens:
            try:
                nxt.append(g.send(out))
            except StopIteration as stop:
                codes.append(int(stop.value))
        assert not nxt or not codes, "ranks ended at different units"
        units = nxt
    return codes


def _outcome(what: str, epoch: int) -> ev.UnitDone:
    if what == "broken":
        return ev.UnitDone(Outcome(committed=False, broken=True, reason="peer died", failed=frozenset({9})))
    if what == "nonfinite":
        return ev.UnitDone(Outcome(committed=False, local_ok=False), nonfinite="loss")
    if what == "discarded":
        return ev.UnitDone(Outcome(committed=False, reason="a member's fault"))
    if what == "view":
        return ev.UnitDone(Outcome(committed=True, pending_epoch=epoch + 1), pending_now=epoch + 1)
    if what == "stop":
        return ev.UnitDone(Outcome(committed=True, stop=True))
    if what == "switch":
        return ev.UnitDone(Outcome(committed=True, switch=1))
    return ev.UnitDone(Outcome(committed=True))


def _decisions(trace: list[ev.Effect]) -> list[ev.Effect]:
    """What every rank must decide alike: not its log lines, not rank 0's duties."""
    rank_own = (ev.Log, ev.Checkpoint, ev.Evaluate, ev.LocalCheckpoint, ev.Finish)
    return [
        replace(e, rank=0) if isinstance(e, ev.RunUnit) else e for e in trace if not isinstance(e, rank_own)
    ]


scripts = st.dictionaries(st.integers(0, 40), st.sampled_from(OUTCOMES), max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    script=scripts,
    kind=st.sampled_from(sorted(BUILT_IN)),
    total=st.integers(1, 60),
    on_abort=st.sampled_from(["redo", "drop"]),
    on_nonfinite=st.sampled_from(["stop", "skip"]),
)
def test_properties_over_random_worlds(script, kind, total, on_abort, on_nonfinite) -> None:
    policy = BoundaryPolicy(
        total_steps=total, on_abort=on_abort, on_nonfinite=on_nonfinite, max_nonfinite=3,
        checkpoint_every_steps=3, eval_every_steps=4,
    )  # fmt: skip
    base = BUILT_IN[kind]
    options = (base, terms(base.regime, base.steps_per_commit, "other"))
    if base.regime is not Regime.VOTE:  # (only a vote carries an agreed switch)
        script = {u: w for u, w in script.items() if w != "switch"}
    worlds = [World(rank=r, size=3, options=options, script=script) for r in range(3)]
    codes = [w.run(policy) for w in worlds]
    for w in worlds:
        # the step never goes back nor past the total
        assert all(a <= b for a, b in zip(w.steps_seen, w.steps_seen[1:])), w.steps_seen
        assert all(0 <= s <= total for s in w.steps_seen)
        # a unit that did not commit gets no duties, no view change and no switch
        for done, after in w.boundaries:
            if done.outcome.committed:
                continue
            assert not any(isinstance(x, ev.Checkpoint | ev.LocalCheckpoint | ev.AfterCommit) for x in after)
            assert not any(isinstance(x, ev.MoveTo | ev.Build) for x in after), after
            if on_abort == "redo" or done.outcome.broken:
                assert not any(isinstance(x, ev.Evaluate) for x in after), after
    # every rank decides the same (the vote agrees the outcomes; the others run the same script)
    assert len({c for c in codes}) == 1, codes
    first = _decisions(worlds[0].trace)
    for w in worlds[1:]:
        assert _decisions(w.trace) == first
    # an end: Finish at the total, or an exit on a stop / non-finite value
    ends = [w.trace[-1] for w in worlds]
    assert all(isinstance(e, ev.Finish) and e.step == total or isinstance(e, ev.Exit) for e in ends), ends


@settings(max_examples=100, deadline=None)
@given(
    kind=st.sampled_from(sorted(BUILT_IN)),
    at=st.integers(1, 40),
    total=st.integers(41, 60),
    script=scripts,
)
@example(kind="allreduce", at=5, total=50, script={4: "discarded"})  # dropped across the step
@example(kind="ps", at=5, total=50, script={4: "broken"})
def test_a_switch_happens_at_the_announced_step_on_every_worker(kind, at, total, script) -> None:
    """Announced for step ``at``: every worker switches at its first boundary at or past it (for
    units of one step: exactly there), whatever the units before it did."""
    base = BUILT_IN[kind]
    k = min(base.steps_per_commit, 10)
    base = terms(base.regime, k, base.name)
    options = (base, terms(base.regime, k, "next"))
    script = {u: w for u, w in script.items() if w in ("commit", "broken", "discarded", "view")}
    policy = BoundaryPolicy(total_steps=total, switch_plan=(SwitchAt(step=at, option=1),), on_abort="drop")
    worlds = [World(rank=r, size=2, options=options, script=script) for r in range(2)]
    for w in worlds:
        w.run(policy)
    switched = [[s for s, option in w.builds if option == 1] for w in worlds]
    assert all(len(s) == 1 for s in switched), switched
    assert len({s[0] for s in switched}) == 1  # the same step on every worker
    step = switched[0][0]
    assert at <= step < at + k  # the first boundary at or past the announced step
    if k == 1:
        assert step == at


def test_the_built_in_strategies_declare_these_terms() -> None:
    from flotilla.sync.adpsgd import ADPSGD
    from flotilla.sync.allreduce import BucketedAllReduce
    from flotilla.sync.base import terms_of
    from flotilla.sync.partial_reduce import PartialReduce
    from flotilla.trainer.stage_engine import StageSync

    assert BucketedAllReduce.traits.regime is BUILT_IN["allreduce"].regime
    assert PartialReduce.traits.regime is BUILT_IN["partial_reduce"].regime
    assert PartialReduce.traits.takes_newcomers is BUILT_IN["partial_reduce"].takes_newcomers is True
    assert ADPSGD.traits.regime is BUILT_IN["adpsgd"].regime
    stage = terms_of(StageSync(steps_per_commit=1000))
    assert (stage.regime, stage.steps_per_commit, stage.takes_newcomers) == (Regime.GROUPS, 1000, False)
    src = Path(__file__).resolve().parents[2] / "src" / "flotilla" / "sync"
    assert (
        "Traits(regime=Regime.VOTE, steps_per_commit=settings.inner_steps" in (src / "diloco.py").read_text()
    )
    assert "Traits(regime=Regime.ALONE, steps_per_commit=self.wave_size" in (src / "via_ps.py").read_text()


def test_an_event_the_machine_does_not_wait_for_is_refused() -> None:
    state, _ = lm.start(BoundaryPolicy(total_steps=5), worker=0)
    with pytest.raises(ValueError, match="UnitDone while waiting in phase FIRST_VIEW"):
        lm.step(state, ev.UnitDone(Outcome(committed=True)))


def test_a_fixed_membership_strategy_refuses_a_late_joiner() -> None:
    state, _ = lm.start(BoundaryPolicy(total_steps=5), worker=7)
    state, fx = lm.step(state, ev.FirstView(ev.ViewFacts(2, 1, 3, joined=True), initial=False, step=0))
    assert fx == [ev.Build(0)]
    state, fx = lm.step(state, ev.Built(BUILT_IN["pipeline-stage"]))
    assert isinstance(fx[-1], ev.Refuse) and "fixed membership" in fx[-1].message


def test_a_groups_strategy_that_fills_newcomers_admits_a_late_joiner() -> None:
    state, _ = lm.start(BoundaryPolicy(total_steps=50), worker=7)
    state, _ = lm.step(state, ev.FirstView(ev.ViewFacts(2, 1, 3, joined=True), initial=False, step=0))
    state, fx = lm.step(state, ev.Built(BUILT_IN["partial_reduce"]))
    assert isinstance(fx[-1], ev.EnterView) and fx[-1].start and not fx[-1].bind
    state, fx = lm.step(state, ev.Entered(step=0, has_state=False, joined_at=20))
    assert ev.SetStep(20) in fx and state.step == 20


def test_a_joiner_starts_where_its_strategy_says() -> None:
    state, _ = lm.start(BoundaryPolicy(total_steps=50), worker=7)
    state, _ = lm.step(state, ev.FirstView(ev.ViewFacts(2, 1, 3, joined=True), initial=False, step=0))
    state, _ = lm.step(state, ev.Built(BUILT_IN["ps"]))
    state, fx = lm.step(state, ev.Entered(step=0, has_state=False, joined_at=12))
    assert ev.SetStep(12) in fx and isinstance(fx[-1], ev.Poll) and state.step == 12


def test_an_initial_worker_starts_where_a_resumed_strategy_stands() -> None:
    def entered(kind: str, restored: int, joined_at: int) -> tuple[lm.Machine, list[ev.Effect]]:
        state, _ = lm.start(BoundaryPolicy(total_steps=50), worker=0)
        view = ev.ViewFacts(1, 0, 3)
        state, _ = lm.step(state, ev.FirstView(view, initial=True, step=0, has_state=True))
        state, _ = lm.step(state, ev.Restored(restored))
        state, _ = lm.step(state, ev.Built(BUILT_IN[kind]))
        return lm.step(state, ev.Entered(restored, has_state=True, joined_at=joined_at))

    state, fx = entered("ps", 0, 12)  # (ps --resume: the shards stand at clock 12)
    assert ev.SetStep(12) in fx and state.step == 12
    state, fx = entered("allreduce", 6, 0)  # (a checkpoint's step: the strategy says nothing)
    assert not any(isinstance(f, ev.SetStep) for f in fx) and state.step == 6


def drive_every_built_in(steps: int = 1000) -> dict[str, int]:
    """Each built-in's terms for ``steps`` steps, with failures on the way; units run per name."""
    ran = {}
    for name, base in BUILT_IN.items():
        script = {u: OUTCOMES[u % 5] for u in range(0, 4000, 37)}
        if base.regime is not Regime.VOTE:
            script = {u: w for u, w in script.items() if w != "switch"}
        policy = BoundaryPolicy(
            total_steps=steps, on_nonfinite="skip", max_nonfinite=1000, checkpoint_every_steps=100
        )
        w = World(rank=0, size=4, options=(base, base), script=script)
        assert w.run(policy) == 0
        assert isinstance(w.trace[-1], ev.Finish) and w.trace[-1].step == steps, (name, w.trace[-1])
        ran[name] = w.units
    return ran


def test_a_thousand_steps_without_torch() -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import json, test_loop_machine as t\n"
        "ran = t.drive_every_built_in(1000)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print(json.dumps(ran))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    ran = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(ran) == set(BUILT_IN) and ran["allreduce"] >= 1000 and ran["diloco"] >= 100


def _switched_at(w: World, option: int) -> list[int]:
    return [step for step, o in w.builds if o == option]


@settings(max_examples=60, deadline=None)
@given(at=st.integers(2, 30), known=st.lists(st.integers(0, 45) | st.none(), min_size=3, max_size=3))
def test_an_announced_switch_rides_the_vote(at, known) -> None:
    """Under a vote, ranks learn of a switch announced for step ``at`` at different units (or
    never): every rank switches at the same step, ``at`` itself if anyone knew in time, else right
    after the first vote a rank that knew of it took part in."""
    if all(k is None for k in known):
        known[0] = 0
    policy = BoundaryPolicy(total_steps=60)
    vote = terms(Regime.VOTE, 1, "allreduce")
    worlds = [World(rank=r, size=3, options=(vote, terms(Regime.VOTE, 1, "next"))) for r in range(3)]
    for w, k in zip(worlds, known):
        if k is not None:
            w.news = [(k, SwitchAt(step=at, option=1))]
    assert lockstep(worlds, policy) == [0, 0, 0]
    first = min(k for k in known if k is not None)
    expected = max(at, first + 1)
    assert [_switched_at(w, 1) for w in worlds] == [[expected]] * 3


@settings(max_examples=60, deadline=None)
@given(at=st.integers(2, 30), known=st.lists(st.integers(0, 45), min_size=3, max_size=3))
def test_without_a_vote_each_worker_switches_when_it_reaches_the_announced_step(at, known) -> None:
    """No vote: a worker that knew in time switches at ``at``; one that learns later, at once."""
    policy = BoundaryPolicy(total_steps=60)
    for regime in (Regime.ALONE, Regime.GROUPS):
        options = (terms(regime, 1, "a"), terms(Regime.VOTE, 1, "allreduce"))
        for r, k in enumerate(known):
            w = World(rank=r, size=3, options=options, news=[(k, SwitchAt(step=at, option=1))])
            assert w.run(policy) == 0
            assert _switched_at(w, 1) == [max(at, k)]
            # (leaving a regime whose replicas drift apart for a vote: the view averages them)
            enters = [e for e in w.trace if isinstance(e, ev.EnterView) and e.average]
            assert len(enters) == 1 and enters[0].bind


def test_a_vote_switching_to_a_vote_does_not_average() -> None:
    policy = BoundaryPolicy(total_steps=20, switch_plan=(SwitchAt(step=5, option=1),))
    w = World(rank=0, size=2, options=(terms(Regime.VOTE, 1, "allreduce"), terms(Regime.VOTE, 1, "diloco")))
    assert w.run(policy) == 0 and _switched_at(w, 1) == [5]
    assert not any(isinstance(e, ev.EnterView) and e.average for e in w.trace)


def test_a_switch_whose_view_fails_to_form_averages_in_the_next_one() -> None:
    """Into a vote from a drifting regime: the exact average is asked for until a view forms."""
    policy = BoundaryPolicy(total_steps=10, switch_plan=(SwitchAt(step=3, option=1),))
    state, _ = lm.start(policy, worker=0)
    state, _ = lm.step(state, ev.FirstView(ev.ViewFacts(1, 0, 2), initial=False, step=0, has_state=True))
    state, _ = lm.step(state, ev.Built(BUILT_IN["ps"]))
    state, fx = lm.step(state, ev.Entered(step=0))
    for _ in range(3):  # units 0, 1, 2: the boundary reaching step 3 switches
        assert isinstance(fx[-1], ev.Poll)
        state, fx = lm.step(state, ev.Polled())
        state, fx = lm.step(state, ev.UnitDone(Outcome(committed=True)))
    assert fx[-2:] == [ev.CloseStrategy(), ev.Build(1)]
    state, fx = lm.step(state, ev.Built(BUILT_IN["allreduce"]))
    assert fx[-1] == ev.EnterView(1, bind=True, wanted=True, start=True, average=True)
    state, fx = lm.step(state, ev.EnterFailed("peer gone"))
    state, fx = lm.step(state, ev.ViewGiven(ev.ViewFacts(2, 0, 1)))
    assert fx[-1] == ev.EnterView(2, bind=True, wanted=True, start=True, average=True)
    state, fx = lm.step(state, ev.Entered(step=3))
    assert not state.average and isinstance(fx[-1], ev.Poll)


ADAPTIVE_TARGETS = ("allreduce", "partial_reduce", "adpsgd", "diloco")


@pytest.mark.parametrize(("src", "dst"), list(itertools.permutations(ADAPTIVE_TARGETS, 2)))
def test_every_transition_between_the_adaptive_targets(src: str, dst: str) -> None:
    """The adaptive policy's targets, each into each (an announced switch, known early): every
    worker switches at the announced step; entering a vote from a regime whose replicas drift
    apart averages them; a vote into a vote does not; a regime without a vote binds no group."""
    a, b = BUILT_IN[src], BUILT_IN[dst]
    at = 20  # (a multiple of DiLoCo's 10 steps a unit)
    policy = BoundaryPolicy(total_steps=60)
    worlds = [
        World(rank=r, size=3, options=(a, b), news=[(0, SwitchAt(step=at, option=1))]) for r in range(3)
    ]
    if a.regime is Regime.VOTE:
        assert lockstep(worlds, policy) == [0, 0, 0]
    else:
        assert [w.run(policy) for w in worlds] == [0, 0, 0]
    for w in worlds:
        assert _switched_at(w, 1) == [at], (src, dst, w.builds)
        enters = [e for e in w.trace if isinstance(e, ev.EnterView) and e.start]
        last = enters[-1]  # the view entered with the new strategy
        assert last.bind == (b.regime is Regime.VOTE)
        assert last.average == (b.regime is Regime.VOTE and a.regime is not Regime.VOTE), (src, dst, last)
        assert isinstance(w.trace[-1], ev.Finish) and w.trace[-1].step == 60
