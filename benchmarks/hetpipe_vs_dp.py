"""HetPipe's virtual workers against the alternatives that fit, on the same emulated cluster:
time to a target training loss (issue 33 item 6).

The cluster is ``examples/hetpipe.yaml``'s: eight devices of four types (speeds 1.0 / 0.6 / 0.4 /
0.25 of a reference, the two weakest with 3 MiB: too little for the model alone), every speed
scaled by ``--scale`` (default 0.2: the eight devices together compute at 0.9 of one host core,
so the 2 cores are not saturated; the CPU use of every run is printed).  Contenders, each a real
``flotilla run`` of that job:

- ``hetpipe``: all eight devices, the virtual workers formed and cut by the planner's placement
  (``--placement``, default ``auto``: the fastest predicted of np / ed / hd; the run's
  ``summary.json`` says which, and the VWs), ``s_local`` (``--s-local``, default 0) and D = 0;
- ``allreduce``: data parallelism over the four devices that hold the model alone (speeds 1.0,
  0.6, 1.0, 0.6), each on a quarter of every batch;
- ``pipeline``: one pipeline (1F1B, 4 microbatches) over as many devices as the model has layers
  (6: one layer each, the embedding on a G device, the head on a Q device, the blocks on V and R).

Time to the target runs from the run's first training record (process start-up excluded) to the
first record at which the mean loss of the last ``--window`` loss records is at or below
``--target``; the run is then stopped (SIGINT).  Within a round every contender runs once (order
alternating between rounds); medians over ``--rounds`` with the runs' spread, and each run's
training samples per second (over its loss records, so throughput and per-sample progress can
be told apart).  Last line:
``ratio=<hetpipe / the best of allreduce and pipeline>`` (goal <= 0.67, acceptable <= 0.85).

    python benchmarks/hetpipe_vs_dp.py --quick          # one round, target 2.6 (a few minutes)
    python benchmarks/hetpipe_vs_dp.py --rounds 3 --json out.json
    python benchmarks/hetpipe_vs_dp.py --quick --inter-node-gbps 0.1   # slow links between nodes

With ``--inter-node-gbps`` every contender runs over emulated links (``cluster.links.emulate``,
``docs/links.md``): that bandwidth (and ``--inter-node-latency-s``) between devices of different
nodes and to the parameter servers, ``--intra-node-gbps`` within a node -- HetPipe's setting,
where data parallelism's all-reduce crosses the slow links every step.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import alternating_orders, cpu_busy, cpu_jiffies, machine_info, median, python, write_json
from _tta import start_run, stop_run
from flotilla.report.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "hetpipe.yaml"
POLL_S = 0.2
GRACE_S = 20.0
# (name, type, node, speed, memory) of the example's devices
DEVICES = {
    "v0": ("V", "n0", 1.0, "64MiB"),
    "v1": ("V", "n0", 1.0, "64MiB"),
    "r0": ("R", "n1", 0.6, "64MiB"),
    "r1": ("R", "n1", 0.6, "64MiB"),
    "g0": ("G", "n2", 0.4, "3MiB"),
    "g1": ("G", "n2", 0.4, "3MiB"),
    "q0": ("Q", "n3", 0.25, "3MiB"),
    "q1": ("Q", "n3", 0.25, "3MiB"),
}
CONTENDERS = {
    "hetpipe": (list(DEVICES), "{kind: hetpipe, placement: %s, s_local: %d}"),
    "allreduce": (["v0", "r0", "v1", "r1"], "{kind: allreduce}"),
    "pipeline": (
        ["g0", "v0", "r0", "v1", "r1", "q0"],
        "{kind: pipeline, schedule: 1f1b, num_stages: 6, num_microbatches: 4}",
    ),
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--target", type=float, default=None, help="training loss (default 2.6 quick, 2.3 full)")
    ap.add_argument("--window", type=int, default=20, help="loss records averaged")
    ap.add_argument("--scale", type=float, default=0.2, help="every device's speed times this")
    ap.add_argument("--s-local", type=int, default=0)
    ap.add_argument("--placement", default="auto", choices=["auto", "np", "ed", "hd"])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--max-run-s", type=float, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--inter-node-gbps", type=float, default=None,
        help="emulated links (cluster.links.emulate): this bandwidth between nodes, to the parameter "
        "servers and the coordinator; within a node --intra-node-gbps",
    )  # fmt: skip
    ap.add_argument("--inter-node-latency-s", type=float, default=0.0)
    ap.add_argument("--intra-node-gbps", type=float, default=10.0)
    a = ap.parse_args()
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.target = a.target or (2.6 if a.quick else 2.3)
    a.max_run_s = a.max_run_s or (70.0 if a.quick else 240.0)
    return a


def command(name: str, a: argparse.Namespace, report: Path) -> list[str]:
    names, strategy = CONTENDERS[name]
    workers = ", ".join(
        f"{{name: {n}, type: {DEVICES[n][0]}, node: {DEVICES[n][1]}, speed: {DEVICES[n][2] * a.scale:.6f}, "
        f"memory_bytes: {DEVICES[n][3]}}}"
        for n in names
    )
    if name == "hetpipe":
        strategy = strategy % (a.placement, a.s_local)
    cmd = [python(), "-m", "flotilla.cli.main", "run", str(EXAMPLE), "--no-progress"]
    cmd += ["--report", str(report), "--run-dir", str(report / "run")]
    cmd += ["--set", f"cluster.workers=[{workers}]", "--set", f"strategy={strategy}"]
    return cmd + links(names, a) + ["--set", f"job.steps={a.steps}", "--set", "report.metrics_every_steps=1"]


def links(names: list[str], a: argparse.Namespace) -> list[str]:
    """With ``--inter-node-gbps``: the contender's links emulated (``docs/links.md``): the default
    link (between nodes; the message plane's) slow, the pairs within a node ``--intra-node-gbps``."""
    if a.inter_node_gbps is None:
        return []
    pairs = ", ".join(
        f"{{a: {x}, b: {y}, bandwidth_gbps: {a.intra_node_gbps}, latency_s: 0.0}}"
        for i, x in enumerate(names)
        for y in names[i + 1 :]
        if DEVICES[x][1] == DEVICES[y][1]
    )
    return [
        "--set", "cluster.links.emulate=true",
        "--set", f"cluster.links.bandwidth_gbps={a.inter_node_gbps}",
        "--set", f"cluster.links.latency_s={a.inter_node_latency_s}",
        "--set", f"cluster.links.pairs=[{pairs}]",
    ]  # fmt: skip


def samples_per_s(report: Path) -> float | None:
    """Training samples per second over the run's loss records (a data-parallel worker's every
    step, a pipeline's last stage: each record's samples once)."""
    recs = [r for r in read_jsonl(report / "metrics.jsonl", missing_ok=True) if r.get("loss") is not None]
    if len(recs) < 2:
        return None
    times = [r["time_s"] for r in recs]
    span = max(times) - min(times)
    return sum(int(r.get("samples", 0)) for r in recs) / span if span > 0 else None


def loss_reached(report: Path, target: float, window: int) -> tuple[float | None, float | None, float]:
    """(first record time, time the target was reached or None, the best windowed mean)."""
    recs = sorted(
        (r for r in read_jsonl(report / "metrics.jsonl", missing_ok=True) if r.get("loss") is not None),
        key=lambda r: r["time_s"],
    )
    if not recs:
        return None, None, float("inf")
    first, best = recs[0]["time_s"], float("inf")
    for i in range(window - 1, len(recs)):
        mean = sum(r["loss"] for r in recs[i - window + 1 : i + 1]) / window
        best = min(best, mean)
        if mean <= target:
            return first, recs[i]["time_s"], best
    return first, None, best


def placement_of(report: Path) -> str | None:
    """The placement a hetpipe run started (its summary; None: none, or no summary yet)."""
    try:
        placement = json.loads((report / "summary.json").read_text()).get("placement")
    except (OSError, ValueError):
        return None
    if not placement:
        return None
    vws = "; ".join(", ".join(v["devices"]) for v in placement["vws"])
    return f"placement {placement['policy']}: VWs {vws}"


def run_once(name: str, a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    report = tmp / f"{name}-{time.monotonic_ns()}"
    cmd = command(name, a, report)
    jiffies, t0 = cpu_jiffies(), time.monotonic()
    proc = start_run(cmd, ROOT)
    hit, first, best, seen = None, None, float("inf"), None
    try:
        while proc.poll() is None:
            time.sleep(POLL_S)
            first, at, best = loss_reached(report, a.target, a.window)
            if first is not None and seen is None:
                seen = time.monotonic()
            if at is not None and first is not None:
                hit = at - first
                break
            if seen is not None and time.monotonic() - seen > a.max_run_s + GRACE_S:
                break
    finally:
        busy = cpu_busy(jiffies)
        err = stop_run(proc)
    if hit is None:
        first, at, best = loss_reached(report, a.target, a.window)  # (a run that ended first)
        hit = at - first if at is not None and first is not None else None
    rate = samples_per_s(report)
    placed = placement_of(report)
    if placed:
        print(f"  ({name}: {placed})", flush=True)
    if hit is None and proc.returncode not in (0, 130, -signal.SIGINT):
        line = next((ln for ln in reversed(err.splitlines()) if ln.startswith("error:")), err[-300:])
        print(f"  ({name} failed: {line[:300]})", flush=True)
        return {"time_to_target_s": None, "best_loss": best, "cpu_busy": busy, "failed": line[:500]}
    return {
        "time_to_target_s": hit,
        "best_loss": best,
        "cpu_busy": busy,
        "samples_per_s": rate,
        "wall_s": time.monotonic() - t0,
    }


def main() -> None:
    a = parse_args()
    names = list(CONTENDERS)
    cells: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hetpipe-vs-dp-") as tmp:
        for r, order in enumerate(alternating_orders(names, a.rounds)):
            for name in order:
                res = run_once(name, a, Path(tmp))
                cells[name].append(res)
                t = res["time_to_target_s"]
                shown = "not reached" if t is None else f"{t:6.2f} s"
                rate = res.get("samples_per_s")
                print(
                    f"round {r} {name:9s}: time to loss {a.target:.2f} = {shown}  "
                    f"best {res['best_loss']:.3f}  {rate or 0:.1f} samples/s  "
                    f"cpu {100 * res['cpu_busy']:.0f}%",
                    flush=True,
                )
    med: dict[str, float | None] = {}
    wall = time.monotonic() - t_start
    shaped = (
        f"; links emulated: {a.inter_node_gbps} Gbit/s {a.inter_node_latency_s} s between nodes, "
        f"{a.intra_node_gbps} Gbit/s within"
        if a.inter_node_gbps is not None
        else ""
    )
    print(f"machine: {machine_info()}; wall {wall:.1f} s; target {a.target}; scale {a.scale}{shaped}")
    for name in names:
        times = [x["time_to_target_s"] for x in cells[name]]
        med[name] = None if any(t is None for t in times) else median(times)
        cpu = median([x["cpu_busy"] for x in cells[name]])
        rate = median([x.get("samples_per_s") or 0.0 for x in cells[name]])
        spread = [None if t is None else round(t, 2) for t in times]
        shown = "n/r" if med[name] is None else f"{med[name]:.2f}"
        print(f"{name:10s} median {shown:>8s} s  {rate:6.1f} samples/s  cpu {100 * cpu:3.0f}%  runs {spread}")
    others = [med[n] for n in ("allreduce", "pipeline") if med[n] is not None]
    ratio = med["hetpipe"] / min(others) if med["hetpipe"] is not None and others else None
    if a.json:
        write_json(
            a.json,
            {"args": {k: str(v) for k, v in vars(a).items()}, "machine": machine_info(), "cells": cells,
             "median_time_to_target_s": med, "ratio": ratio},
        )  # fmt: skip
    print(f"ratio={'n/a' if ratio is None else f'{ratio:.3f}'}")


if __name__ == "__main__":
    main()
