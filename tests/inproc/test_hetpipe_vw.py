"""HetPipe virtual workers at run time (SPEC §2; ``sync/hetpipe_stage.py`` on the stage runtime,
``ps.vpull`` on the parameter server): VWs of 2-3 pipeline stages, cut differently, train through
in-process PS shards under WSP.  Every stage records what the weights of each of its forwards
held; SPEC §2's bounds are checked on those records (``ps/wsp.check_sglobal_bound``):

- over random VW speeds and transient slowdowns the bounds hold and the loss falls;
- the paper's worked example (D = 0, s_local = 3) holds on the records exactly;
- a stage keeps running the minibatches in flight while another waits at the WSP gate;
- mutations -- a stage that ignores the gate, servers that run a larger D -- are caught by the
  run-time check (the slow VW is held back by an event, not by a duration).
"""

from __future__ import annotations

import random
import threading

import pytest

from flotilla.pipeline.schedule import Forward, OptimizerStep
from flotilla.ps.consistency import WSP, s_global
from flotilla.ps.wsp import check_sglobal_bound, check_slocal_bound, max_observed_staleness
from flotilla.sync.hetpipe_plan import WavePlan

from ._hetpipe import VWRun, run_vws

pytestmark = pytest.mark.timeout(240)
CUTS = [(2, 4, 6), (3, 6), (1, 4, 6)]  # the char LM's 6 layers, cut three ways


def _violations(run: VWRun, wsp: WSP) -> list:
    return [
        v
        for recs in run.records.values()
        for v in check_sglobal_bound(recs, wsp) + check_slocal_bound(recs, wsp)
    ]


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


@pytest.mark.parametrize(("k", "s_local", "distance", "seed"), [(2, 1, 0, 1), (3, 2, 1, 2), (2, 3, 2, 3)])
def test_the_bounds_hold_at_run_time_over_random_speeds_and_the_loss_falls(
    k: int, s_local: int, distance: int, seed: int
) -> None:
    rng = random.Random(seed)
    speeds = [rng.choice([1.0, 0.6, 0.35]) for _ in range(k)]
    run = run_vws(
        CUTS[:k], s_local=s_local, clock_distance=distance, steps=32, speeds=speeds, slowdown_p=0.2, seed=seed
    )
    assert not run.errors
    wsp = WSP(s_local=s_local, clock_distance=distance)
    assert sum(len(r) for r in run.records.values()) == 32 * sum(len(c) for c in CUTS[:k])  # every forward
    assert not _violations(run, wsp)
    observed = max(max_observed_staleness(r) for r in run.records.values())
    assert observed <= s_global(wsp)
    for v in range(k):
        losses = [run.losses[v][m] for m in sorted(run.losses[v])]
        assert _mean(losses[-8:]) < 0.85 * _mean(losses[:8]), (v, losses)


def test_the_papers_worked_example_holds_on_the_records() -> None:
    """D = 0, s_local = 3 (s_global = 6): minibatch 11 runs with the global updates of wave 0
    (minibatches 1-4) plus its own local updates 5, 6, 7; minibatch 12 runs only with wave 1
    (up to minibatch 8) of every VW."""
    run = run_vws(CUTS[:2], s_local=3, clock_distance=0, steps=16)
    assert not run.errors
    for v in range(2):
        recs = {r.minibatch: r for r in run.records[(v, 0)]}
        r11, r12 = recs[11], recs[12]
        assert r11.global_waves[v] == 1 and min(r11.global_waves) >= 1
        assert r11.local_updates == frozenset({5, 6, 7})
        assert min(r12.global_waves) >= 2
        assert max(r.observed_staleness for r in recs.values()) <= 6


def test_a_stage_keeps_running_while_its_vw_waits_at_the_gate() -> None:
    """VW 0's stage 0 reaches the gate (before minibatch 8's forward, s_local = 3, D = 0) while
    VW 1 is held back; only then does VW 0's stage 1 go on with its forward of minibatch 7 and
    backward and update of minibatch 5 (in flight), and only after that update is VW 1
    released.  So stage 1 ran while stage 0 was held at the gate, and stage 0 did wait."""
    at_gate, stage1_done, vw1_go = threading.Event(), threading.Event(), threading.Event()

    def hook(v, i, rt, sync) -> None:
        inner, after = rt.before_forward, rt.after_update

        def before_forward(b: int) -> None:
            if (v, i, b) == (0, 0, 7):
                at_gate.set()
            if (v, i, b) == (0, 1, 6):
                assert at_gate.wait(60)
            if (v, i, b) == (1, 0, 0):
                assert vw1_go.wait(60)
            inner(b)

        def after_update(u: int, module) -> None:
            after(u, module)
            if (v, i, u) == (0, 1, 4):
                stage1_done.set()
                vw1_go.set()

        rt.before_forward, rt.after_update = before_forward, after_update

    run = run_vws([(3, 6), (3, 6)], s_local=3, clock_distance=0, steps=12, hook=hook)
    assert not run.errors and stage1_done.is_set()
    assert run.waited_s[(0, 0)] > 0
    tl0, tl1 = run.results[(0, 0)].timeline, run.results[(0, 1)].timeline
    f7 = next(e for e in tl0 if isinstance(e.action, Forward) and e.action.microbatch_idx == 7)
    u4 = next(e for e in tl1 if isinstance(e.action, OptimizerStep) and e.action.reads_version == 4)
    assert u4.end_s <= f7.start_s  # stage 1's update of minibatch 5 before stage 0 passed the gate
    assert not _violations(run, WSP(s_local=3, clock_distance=0))


class _NoGate(WavePlan):
    def needed_clock(self, b: int) -> int:
        return 0  # the mutation: a stage that never waits for the pull


def _hold_vw1_until_vw0_ends(steps: int):
    done = threading.Event()

    def hook(v, i, rt, sync) -> None:
        inner = rt.before_forward

        def before_forward(b: int) -> None:
            if (v, i) == (1, 0) and b == 0:
                assert done.wait(60)
            inner(b)
            if (v, i) == (0, 0) and b == steps - 1:
                done.set()

        rt.before_forward = before_forward

    return hook


@pytest.mark.parametrize("mutation", ["stage ignores the gate", "servers run a larger D"])
def test_a_broken_gate_is_caught_by_the_run_time_check(mutation: str) -> None:
    steps, wsp = 16, WSP(s_local=1, clock_distance=0)
    kwargs = (
        {"plan": lambda p: _NoGate(s_local=p.s_local, num_minibatches=p.num_minibatches)}
        if mutation.startswith("stage")
        else {"server_distance": 10}
    )
    run = run_vws(
        CUTS[:2], s_local=1, clock_distance=0, steps=steps, hook=_hold_vw1_until_vw0_ends(steps), **kwargs
    )
    assert not run.errors
    caught = [v for v in _violations(run, wsp) if v.vw == 0]
    assert caught and all(v.kind == "global" for v in caught)
    assert max(max_observed_staleness(r) for r in run.records.values()) > s_global(wsp)
