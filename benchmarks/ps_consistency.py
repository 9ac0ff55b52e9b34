"""Time to a fixed test accuracy under BSP, SSP(3) and ASP with a straggler (strategy ps).

mnist1d, cnn1d, 4 workers (one at speed 0.33), 2 server shards: each run is a real
``flotilla run examples/ps_ssp.yaml`` (coordinator, servers and workers as processes) with only
``strategy.consistency`` changed.  The consistency models run alternately, the order reversed
every round.  Worker rank 0 evaluates the global weights every ``--eval-every`` clocks; the
script follows the run's live ``evals.jsonl`` and stops the run (Ctrl-C, which the launcher turns
into a clean shutdown) at the first evaluation at or above ``--target``.  Time to accuracy runs
from the first training record to that evaluation; process start-up is excluded.

``--quick`` (under 60 s) runs BSP and SSP once each (the two the ratio needs) to 0.75; the full
run adds ASP, 3 rounds, target 0.90.  Last line: ``ratio=<median SSP time / median BSP time>``.

    python benchmarks/ps_consistency.py --quick
    python benchmarks/ps_consistency.py --json out.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import alternating_orders, median, python, report_medians
from _tta import run_to_target

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="BSP and SSP, 1 round, target 0.75 (< 60 s)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--target", type=float, default=None, help="test accuracy to reach")
    ap.add_argument("--eval-every", type=int, default=20, help="clocks between evaluations")
    ap.add_argument("--max-run-s", type=float, default=None, help="give up on a run after this long")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for every run (e.g. strategy.cached_reads=true)",
    )
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    a.models = ["bsp", "ssp"] if a.quick else ["bsp", "ssp", "asp"]
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.target = a.target or (0.75 if a.quick else 0.90)
    a.max_run_s = a.max_run_s or (26.0 if a.quick else 120.0)
    return a


def run_once(model: str, a: argparse.Namespace, tmp: Path) -> dict:
    report = tmp / f"{model}-{time.monotonic_ns()}"
    cmd = [
        python(),
        "-m",
        "flotilla.cli.main",
        "run",
        str(ROOT / "examples/ps_ssp.yaml"),
        "--no-progress",
        "--report",
        str(report),
        "--run-dir",
        str(report / "run"),
        "--set",
        f"strategy.consistency={{kind: {model}{', staleness: 3' if model == 'ssp' else ''}}}",
        "--set",
        f"job.eval_every_steps={a.eval_every}",
    ]
    for extra in a.set:
        cmd += ["--set", extra]
    return {"model": model, **run_to_target(cmd, ROOT, report, a.target, a.max_run_s)}


def main() -> None:
    a = parse_args()
    results: dict[str, list[dict]] = {m: [] for m in a.models}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ps-consistency-") as tmp:
        for r, order in enumerate(alternating_orders(a.models, a.rounds)):
            for model in order:
                res = run_once(model, a, Path(tmp))
                results[model].append(res)
                t = res["time_to_target_s"]
                print(
                    f"round {r} {model}: time to {a.target:.2f} = "
                    f"{'not reached' if t is None else f'{t:.2f} s'} (best {res['best_accuracy']:.4f}, "
                    f"command {res['command_wall_s']:.1f} s)",
                    flush=True,
                )
    med = {}
    for model, runs in results.items():
        times = [x["time_to_target_s"] for x in runs]
        if any(t is None for t in times):
            raise SystemExit(
                f"{model} did not reach {a.target} within {a.max_run_s} s in every "
                f"round: no ratio (raise --max-run-s or lower --target)"
            )
        med[model] = median(times)
    report_medians(
        a,
        t_start,
        "time_to_target_s",
        med,
        {m: [x["time_to_target_s"] for x in runs] for m, runs in results.items()},
        med["ssp"] / med["bsp"],
        digits=2,
        extra={"results": results},
    )


if __name__ == "__main__":
    main()
