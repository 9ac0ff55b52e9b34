"""Time to a target test accuracy under heterogeneity, for every data-parallel strategy.

mnist1d, cnn1d, N = 4 workers; each run is a real ``flotilla run examples/partial_reduce.yaml``
with the strategy and the cluster overridden.  Devices are emulated SLOWER than the host so the 2
cores are not saturated; the CPU utilisation of every run is printed.  Scenarios (base speed per
scenario; ``--base-speed`` sets both):

- ``straggler``: one worker 3x slower than the others (speed base/3), base 0.25;
- ``transient``: every worker at the base speed with transient slowdowns (p = 0.1, 5x), base 0.1.
  At 0.25 a step's emulated compute (~20 ms) is below its parameter-server round trips (~40 ms
  of pull wait per step, measured on this machine), so the slowdowns bounded staleness can
  absorb are a small part of every step and the comparison would measure the message plane; at
  0.1 compute dominates, as on the slow devices the scenario stands for;
- ``churn``: every worker at the base speed (0.25), revoked and replaced as the AWS p3 spot trace
  says (``examples/traces/aws-p3-spot.csv`` from trace hour 6 (``CHURN_START_MS``), 4 slots,
  time-scaled by ``CHURN_SCALE`` = 360: one trace hour every 10 s of training, the trace's clock
  starting at the first step; 17 changes (9 revocations, 5 in the first 30 s) in 100 s, the
  first at 7.3 s; with replacements taking 10 s to start, a worker holding the model is always
  left).
  A revoked worker is SIGKILLed; a replacement starts a new process that joins the running job.
  From the trace's start instead, all four first workers are gone by ~10 s while their
  replacements still start up: the model survives only in checkpoints (allreduce's automatic
  ones), and partial reduce and the adaptive policy cannot finish -- a real property of that
  window, not a comparison of strategies, hence the later window.

Contenders: allreduce; ps BSP, SSP(3), ASP; partial_reduce CPR and DPR (P = 3); adpsgd (whose
evaluations are of the average of the live replicas, what it exports); diloco (H = 10, outer
Nesterov 0.7/0.9); adaptive (the policy ``CONTENDERS['adaptive']``: AD-PSGD while the straggler
ratio is above 2, DiLoCo otherwise -- one policy for every scenario, given at job start; chosen
from this table's single rounds: AD-PSGD won under the straggler, DiLoCo under churn; a first
policy, AD-PSGD while workers are being revoked and all-reduce otherwise, took 14.2 s under churn
against DiLoCo's 7.4 s, one round each, 2026-11-27).  Within a round every contender runs once
(order alternating between rounds); the median over ``--rounds`` is reported per cell with the
runs' spread.  Rank 0 evaluates every ``--eval-every`` steps; the run is stopped at the first
evaluation >= ``--target``; time to accuracy runs from the first training record.

Last line: ``ratio=<DPR / allreduce time to target, straggler>``; the JSON (``--json``) has every
cell, ``ssp_over_bsp_transient``, ``adpsgd_over_allreduce`` (straggler) and
``adaptive_over_best_fixed`` (churn: adaptive over the best of the fixed strategies), and
``--markdown`` writes the table.  ``--quick``: one round, target 0.75, the five of the table
(allreduce, DPR, AD-PSGD, DiLoCo, adaptive) under the straggler and under churn, BSP and SSP
under transient slowdowns (under 8 minutes).  ``--table``: the five of the table in all three
scenarios (``--rounds 3``: the published table).

    python benchmarks/heterogeneity_tta.py --quick
    python benchmarks/heterogeneity_tta.py --rounds 3 --json out.json
    python benchmarks/heterogeneity_tta.py --table --rounds 3 --markdown table.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import alternating_orders, machine_info, median, python, write_json
from _tta import run_to_target

ROOT = Path(__file__).resolve().parents[1]
PS = "{kind: ps, num_servers: 2, update: server_sgd, consistency: %s}"
PR = "{kind: partial_reduce, group_size: 3, weighting: %s, alpha: 0.5, group_timeout_s: 0.5}"
CONTENDERS = {
    "allreduce": "{kind: allreduce}",
    "ps_bsp": PS % "{kind: bsp}",
    "ps_ssp3": PS % "{kind: ssp, staleness: 3}",
    "ps_asp": PS % "{kind: asp}",
    "pr_cpr": PR % "constant",
    "pr_dpr": PR % "dynamic",
    "adpsgd": "{kind: adpsgd}",
    "diloco": "{kind: diloco, inner_steps: 10, outer_lr: 0.7, outer_momentum: 0.9}",
    "adaptive": (
        "{kind: adaptive, dwell_steps: 30, every_s: 0.5, window_s: 30, rules: ["
        "{when: {straggler_ratio_gt: 2}, use: {kind: adpsgd}}, "
        "{otherwise: {kind: diloco, inner_steps: 10, outer_lr: 0.7, outer_momentum: 0.9}}]}"
    ),
}
TABLE = ["allreduce", "pr_dpr", "adpsgd", "diloco", "adaptive"]  # the five of the published table
FIXED = [n for n in TABLE if n != "adaptive"]
BASE_SPEED = {"straggler": 0.25, "transient": 0.1, "churn": 0.25}
CHURN_SCALE = 360.0  # trace seconds per run second
CHURN_START_MS = 6 * 3600 * 1000  # trace hour 6: churn, but never every holder of the model at once
QUICK = {"straggler": TABLE, "transient": ["ps_bsp", "ps_ssp3"], "churn": TABLE}
FULL = {"straggler": list(CONTENDERS), "transient": list(CONTENDERS), "churn": TABLE}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--target", type=float, default=None)
    ap.add_argument("--base-speed", type=float, default=None, help="both scenarios (default: per scenario)")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--max-run-s", type=float, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None, help="write the table (markdown) here")
    ap.add_argument("--table", action="store_true", help="only the five of the table, in all three scenarios")
    ap.add_argument("--only", default="", help="comma-separated scenarios to run (default: all)")
    a = ap.parse_args()
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.target = a.target or (0.75 if a.quick else 0.90)
    a.max_run_s = a.max_run_s or (75.0 if a.quick else 240.0)
    return a


def cluster_sets(scenario: str, base: float) -> list[str]:
    if scenario == "straggler":
        speeds = [base, base, base, base / 3]
        workers = ", ".join(f"{{name: w{i}, speed: {s:.6f}}}" for i, s in enumerate(speeds))
        return ["--set", f"cluster.workers=[{workers}]"]
    workers = ", ".join(f"{{name: w{i}, speed: {base}}}" for i in range(4))
    if scenario == "churn":
        trace = (
            f"{{file: traces/aws-p3-spot.csv, time_scale: {CHURN_SCALE}, max_workers: 4, "
            f"start_ms: {CHURN_START_MS}}}"
        )
        return [
            "--set",
            f"cluster.workers=[{workers}]",
            "--set",
            f"cluster.defaults.speed={base}",  # (the replacements' speed)
            "--set",
            f"cluster.revocations={{trace: {trace}, time_from_step: 1}}",
        ]
    return [
        "--set",
        f"cluster.workers=[{workers}]",
        "--set",
        "cluster.defaults.slowdown={p: 0.1, factor: 5.0, seed: 0}",
    ]


def run_once(name: str, scenario: str, a: argparse.Namespace, tmp: Path) -> dict:
    """One run; a run that fails before the target (e.g. every worker holding the model revoked)
    is "not reached", with its error line, and the benchmark goes on."""
    report = tmp / f"{scenario}-{name}-{time.monotonic_ns()}"
    cmd = [python(), "-m", "flotilla.cli.main", "run", str(ROOT / "examples/partial_reduce.yaml")]
    cmd += ["--no-progress", "--report", str(report), "--run-dir", str(report / "run")]
    cmd += ["--set", f"strategy={CONTENDERS[name]}", "--set", f"job.eval_every_steps={a.eval_every}"]
    cmd += cluster_sets(scenario, a.base_speed or BASE_SPEED[scenario])
    try:
        return run_to_target(cmd, ROOT, report, a.target, a.max_run_s)
    except SystemExit as exc:
        line = next(
            (ln for ln in reversed(str(exc).splitlines()) if ln.startswith("error:")), str(exc)[-300:]
        )
        print(f"  ({scenario} {name} failed: {line[:300]})", flush=True)
        return {"time_to_target_s": None, "best_accuracy": 0.0, "cpu_busy": 0.0, "failed": line[:500]}


def table(med: dict, cells: dict, a: argparse.Namespace) -> str:
    """The markdown table: per strategy (rows) and scenario (columns), the median time to the
    target with the runs' spread (min-max), "n/r" when a run did not reach it."""
    scenarios = list(cells)
    names = [n for n in CONTENDERS if any(n in cells[s] for s in scenarios)]
    head = f"| strategy | {' | '.join(f'{s} (s)' for s in scenarios)} |"
    rows = [head, "|---|" + "---|" * len(scenarios)]
    for name in names:
        out = []
        for s in scenarios:
            runs = cells[s].get(name)
            if not runs:
                out.append("")
                continue
            times = [x["time_to_target_s"] for x in runs]
            if med[s][name] is None:
                got = sum(t is not None for t in times)
                out.append(f"n/r ({got}/{len(times)} reached)")
            else:
                spread = f" ({min(times):.1f}-{max(times):.1f})" if len(times) > 1 else ""
                out.append(f"{med[s][name]:.1f}{spread}")
        rows.append(f"| {name} | {' | '.join(out)} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    a = parse_args()
    plan = QUICK if a.quick else FULL
    if a.table:
        plan = {s: list(TABLE) for s in BASE_SPEED}
    if a.only:
        wanted = [s.strip() for s in a.only.split(",") if s.strip()]
        unknown = sorted(set(wanted) - set(plan))
        if unknown:
            raise SystemExit(f"--only: unknown scenario(s) {unknown}; choose from {sorted(plan)}")
        plan = {s: plan[s] for s in wanted}
    cells: dict[str, dict[str, list[dict]]] = {s: {n: [] for n in names} for s, names in plan.items()}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="het-tta-") as tmp:
        for r in range(a.rounds):
            for scenario, names in plan.items():
                for name in alternating_orders(names, a.rounds)[r]:
                    res = run_once(name, scenario, a, Path(tmp))
                    cells[scenario][name].append(res)
                    t = res["time_to_target_s"]
                    print(
                        f"round {r} {scenario:9s} {name:9s}: time to {a.target:.2f} = "
                        f"{'not reached' if t is None else f'{t:6.2f} s'}  best {res['best_accuracy']:.4f}  "
                        f"cpu {100 * res['cpu_busy']:.0f}%",
                        flush=True,
                    )
    med: dict[str, dict[str, float | None]] = {}
    print(f"machine: {machine_info()}; wall {time.monotonic() - t_start:.1f} s; target {a.target}")
    print(f"{'scenario':10s} {'strategy':10s} {'median_s':>9s} {'cpu':>5s}  runs")
    for scenario, by_name in cells.items():
        med[scenario] = {}
        for name, runs in by_name.items():
            times = [x["time_to_target_s"] for x in runs]
            m = None if any(t is None for t in times) else median(times)
            med[scenario][name] = m
            cpu = median([x["cpu_busy"] for x in runs])
            shown = "n/r" if m is None else f"{m:9.2f}"
            rounded = [None if t is None else round(t, 2) for t in times]
            print(f"{scenario:10s} {name:10s} {shown:>9s} {100 * cpu:4.0f}%  {rounded}")

    def ratio(s: str, num: str, den: str) -> float | None:
        x, y = med.get(s, {}).get(num), med.get(s, {}).get(den)
        return None if x is None or y is None else x / y

    r_main = ratio("straggler", "pr_dpr", "allreduce")
    r_ssp = ratio("transient", "ps_ssp3", "ps_bsp")
    r_ad = ratio("straggler", "adpsgd", "allreduce")
    fixed = [med.get("churn", {}).get(n) for n in FIXED if n in med.get("churn", {})]
    best = min((x for x in fixed if x is not None), default=None)
    adaptive = med.get("churn", {}).get("adaptive")
    r_adapt = None if best is None or adaptive is None else adaptive / best
    md = table(med, cells, a)
    print(md, end="")
    if a.markdown:
        a.markdown.write_text(md)
    if a.json:
        write_json(
            a.json,
            {
                "args": {k: str(v) for k, v in vars(a).items()},
                "machine": machine_info(),
                "cells": cells,
                "median_time_to_target_s": med,
                "ratio": r_main,
                "ssp_over_bsp_transient": r_ssp,
                "adpsgd_over_allreduce": r_ad,
                "adaptive_over_best_fixed": r_adapt,
                "table": md,
            },
        )
    print(f"ssp_over_bsp_transient={'n/a' if r_ssp is None else f'{r_ssp:.3f}'}")
    print(f"adpsgd_over_allreduce={'n/a' if r_ad is None else f'{r_ad:.3f}'}")
    print(f"adaptive_over_best_fixed={'n/a' if r_adapt is None else f'{r_adapt:.3f}'}")
    print(f"ratio={'n/a' if r_main is None else f'{r_main:.3f}'}")


if __name__ == "__main__":
    main()
