"""Time to a fixed test accuracy under BSP, SSP(3) and ASP with a straggler (strategy ps).

mnist1d, cnn1d, 4 workers (one at speed 0.33), 2 server shards: each run is a real
``flotilla run`` (coordinator, servers and workers as processes). The consistency models run
alternately, the order reversed every round. Time to accuracy is measured from the first
training record to the first evaluation of the global weights (worker rank 0, every
``--eval-every`` clocks) at or above ``--target``; process start-up is excluded.

Last line: ``ratio=<median SSP time / median BSP time>``.

    python benchmarks/ps_consistency.py --quick          # < 60 s
    python benchmarks/ps_consistency.py --json out.json  # full run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import alternating_orders, machine_info, median, python, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"bsp": "bsp", "ssp": "ssp", "asp": "asp"}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small data set, 1 round (< 60 s)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--target", type=float, default=None, help="test accuracy to reach")
    ap.add_argument("--samples", type=int, default=None, help="mnist1d samples (train+test)")
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=10, help="clocks between evaluations")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.target = a.target or (0.75 if a.quick else 0.92)
    a.samples = a.samples or 25000
    a.epochs = a.epochs or (2 if a.quick else 6)
    return a


def run_once(model: str, a: argparse.Namespace, tmp: Path) -> dict:
    report = tmp / f"{model}-{time.monotonic_ns()}"
    cmd = [python(), "-m", "flotilla.cli.main", "run", str(ROOT / "examples/ps_ssp.yaml"),
           "--no-progress", "--report", str(report), "--run-dir", str(report / "run"),
           "--set", f"strategy.consistency={model}", "--set", "strategy.staleness=3",
           "--set", f"job.dataset.num_samples={a.samples}", "--set", f"job.epochs={a.epochs}",
           "--set", f"job.eval_every_steps={a.eval_every}"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{model} run failed:\n{proc.stderr[-2000:]}")
    recs = [json.loads(line) for line in (report / "metrics.jsonl").read_text().splitlines()]
    start = min(r["time_s"] for r in recs)
    summary = json.loads((report / "summary.json").read_text())
    evals = sorted((e["time_s"], e["test_accuracy"]) for e in summary["evals"])
    hit = next((t - start for t, acc in evals if acc >= a.target), None)
    return {"model": model, "time_to_target_s": hit, "final_accuracy": summary["test_accuracy"],
            "train_wall_s": evals[-1][0] - start if evals else None, "command_wall_s": wall}


def main() -> None:
    a = parse_args()
    results: dict[str, list[dict]] = {m: [] for m in MODELS}
    with tempfile.TemporaryDirectory(prefix="ps-consistency-") as tmp:
        for r, order in enumerate(alternating_orders(list(MODELS), a.rounds)):
            for model in order:
                res = run_once(model, a, Path(tmp))
                results[model].append(res)
                print(f"round {r} {model}: time to {a.target:.2f} = {res['time_to_target_s']} s, "
                      f"final accuracy {res['final_accuracy']:.4f}", flush=True)
    med = {}
    for model, runs in results.items():
        times = [x["time_to_target_s"] for x in runs]
        if any(t is None for t in times):
            raise SystemExit(f"{model} never reached {a.target}: raise --epochs or lower --target")
        med[model] = median(times)
    info = machine_info()
    print(f"machine: {info}")
    print("model  median_time_to_target_s  runs")
    for model in MODELS:
        print(f"{model:5s}  {med[model]:23.2f}  {[round(x['time_to_target_s'], 2) for x in results[model]]}")
    ratio = med["ssp"] / med["bsp"]
    if a.json:
        write_json(a.json, {"args": {k: str(v) for k, v in vars(a).items()}, "machine": info,
                            "results": results, "median_time_to_target_s": med, "ratio": ratio})
    print(f"ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
