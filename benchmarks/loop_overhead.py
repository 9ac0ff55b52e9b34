"""Benchmark: the cost of flotilla's loop itself per unit -- the pure loop machine and its executor
(``trainer/loop_machine.py``, ``trainer/loop.py``) -- with parts that do no work.

Both contenders drive the same fake parts (a one-member view, a strategy that commits at once, an
engine that computes nothing, duties and records that do nothing) for ``--units`` units:

- ``loop``: ``flotilla.trainer.loop.Loop`` (what every worker and stage runs: poll, unit,
  boundary decision, records, duties, hooks);
- ``bare``: a Python ``for`` loop calling the same engine and strategy once per unit (what no loop
  at all would cost).

Rounds alternate the contenders (order swapped every round).  The difference is what the loop adds
to every step of a real job; compare it with a step's time (``overhead_vs_plain.py`` prints
"between steps" for a whole worker).  No torch compute; one process, one thread.  To compare two
trees, run it under each (``PYTHONPATH=<other tree>/src``).

Output: per round, microseconds per unit; then the medians, ``loop_us=<the loop's median>`` and,
as the last line, ``ratio=<loop us per unit / bare us per unit>``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common
from flotilla.sync.base import Outcome, Proposal, Regime, SyncStrategy, Traits
from flotilla.trainer.boundary import BoundaryPolicy
from flotilla.trainer.loop import Loop, LoopParts
from flotilla.trainer.parts import StaticMembership, UnitWhere
from flotilla.trainer.step import StepResult


class _Sync(SyncStrategy):
    kind = "bench"
    traits = Traits(regime=Regime.VOTE)

    def begin_step(self, step: int) -> None:
        pass

    def synchronize(self, proposal: Proposal) -> Outcome:
        return Outcome(committed=True)


class _Strategies:
    def __call__(self, option: int, view: Any) -> SyncStrategy:
        return _Sync()

    def describe(self, option: int) -> str:
        return "bench"

    def known(self, option: int) -> bool:
        return option == 0


class _Group:
    rank, world_size = 0, 1

    def allreduce(self, tensor: Any, op: str = "sum") -> None:
        pass

    def broadcast(self, tensors: Any, src: int) -> None:
        pass

    def close(self) -> None:
        pass


class _Engine:
    def __init__(self) -> None:
        self.step, self.has_state = 0, True

    def run_unit(self, where: UnitWhere, strategy: SyncStrategy, proposal: Proposal) -> StepResult:
        strategy.begin_step(where.first_step)
        return StepResult(strategy.synchronize(proposal), 1.0, 8, 0.0, 0.0)

    def export_state(self) -> tuple[dict[str, Any], list[Any]]:
        return {}, []

    def import_state(self, meta: dict[str, Any], tensors: list[Any]) -> None:
        pass

    def digest(self) -> str:
        return ""

    def after_commit(self) -> None:
        pass

    def average(self, group: Any) -> None:
        pass


class _Duties:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: 0 if name == "finish" else None


class _Records:
    def unit(self, *a: Any, **k: Any) -> None:
        pass

    def discarded(self, *a: Any, **k: Any) -> None:
        pass

    def flush(self) -> None:
        pass


def run_loop(units: int) -> float:
    engine = _Engine()
    loop = Loop(
        LoopParts(
            membership=StaticMembership(0, 1, make_group=lambda view: _Group()),
            engine=engine,
            strategies=_Strategies(),
            duties=_Duties(),
            records=_Records(),
            policy=BoundaryPolicy(total_steps=units, checkpoint_every_steps=100, eval_every_steps=500),
        )
    )
    t0 = time.perf_counter()
    code = loop.run()
    dt = time.perf_counter() - t0
    if code != 0 or engine.step != units:
        raise RuntimeError(f"the loop ended with code {code} at step {engine.step} of {units}")
    return dt / units * 1e6


def run_bare(units: int) -> float:
    engine, sync, view = _Engine(), _Sync(), StaticMembership(0, 1, make_group=None).view
    t0 = time.perf_counter()
    for step in range(units):
        res = engine.run_unit(UnitWhere(step, step, view, 0), sync, Proposal())
        if res.decision.committed:
            engine.step = step + 1
    return (time.perf_counter() - t0) / units * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--units", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="5 rounds of 5,000 units")
    args = ap.parse_args(argv)
    units, rounds = (5_000, 5) if args.quick else (args.units, args.rounds)
    runs: dict[str, list[float]] = {"loop": [], "bare": []}
    for r, order in enumerate(_common.alternating_orders(list(runs), rounds)):
        for name in order:
            runs[name].append(run_loop(units) if name == "loop" else run_bare(units))
        print(f"round {r + 1}: loop {runs['loop'][-1]:.1f} us/unit, bare {runs['bare'][-1]:.1f} us/unit")
    loop_us, bare_us = _common.median(runs["loop"]), _common.median(runs["bare"])
    print(f"machine: {_common.machine_info()}")
    print(f"median: loop {loop_us:.1f} us per unit, bare {bare_us:.1f} us per unit (the loop adds "
          f"{loop_us - bare_us:.1f} us to every unit)")  # fmt: skip
    print(f"loop_us={loop_us:.1f}")
    print(f"ratio={loop_us / bare_us:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
