"""Starting role processes: forked from the run's zygote (``launch/zygote.py``) against ``exec``.

Two measurements, each alternating the contender (``$FLOTILLA_SPAWN=fork``, the default) and the
baseline (``exec``) round by round:

- ``run``: a whole ``flotilla run examples/tiny.yaml`` with ``--workers`` workers and 5 steps
  (what most of a run's start is): the CPU time of the launcher and everything it started
  (``RUSAGE_CHILDREN``: the zygote reaps its children and is reaped by the launcher) and the wall
  time, per round;
- ``ready``: one ``Supervisor`` that starts one child at a time, the child importing what a worker
  imports before it trains (torch, ``torch._dynamo``, ``flotilla.roles.worker``) and saying so:
  the time from ``spawn`` to that line (what a respawned worker, a stage or a virtual worker
  coming back waits before it can do anything), the zygote already ready.

Printed: medians over the rounds with their range, per-round ratios ``fork / exec``, the CPU
busy share during each measurement; last line ``ratio=<median per-round CPU ratio of run>``.

    python benchmarks/spawn_cost.py --quick          # 3 rounds
    python benchmarks/spawn_cost.py --rounds 7 --json out.json
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_busy, cpu_jiffies, machine_info, median, write_json
from flotilla.launch.supervisor import Supervisor
from flotilla.launch.zygote_client import SPAWN_VAR

ROOT = Path(__file__).resolve().parent.parent
PROBE = "import torch, torch._dynamo, flotilla.roles.worker\nprint('ready', flush=True)\n"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    a.rounds = a.rounds or (3 if a.quick else 7)
    return a


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one_run(mode: str, workers: int) -> dict[str, float]:
    env = {**os.environ, SPAWN_VAR: mode}
    cmd = [sys.executable, "-m", "flotilla.cli.main", "run", str(ROOT / "examples" / "tiny.yaml")]
    cmd += ["--set", "job.steps=5", "--set", f"cluster.num_workers={workers}", "--no-progress"]
    cpu0, t0, busy0 = _children_cpu(), time.perf_counter(), cpu_jiffies()
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, capture_output=True)
    return {"cpu_s": _children_cpu() - cpu0, "wall_s": time.perf_counter() - t0, "busy": cpu_busy(busy0)}


def one_ready(sup: Supervisor, log_dir: Path, index: int) -> float:
    t0 = time.perf_counter()
    child = sup.spawn(f"p{index}", [sys.executable, "-m", "spawn_probe"], role="worker")
    while "ready" not in child.log_path.read_text(errors="replace"):
        if child.proc.poll() is not None:
            raise RuntimeError(f"the probe exited: {child.log_tail()}")
        time.sleep(0.005)
    took = time.perf_counter() - t0
    child.proc.wait(timeout=60)
    return took


def ready_rounds(mode: str, rounds: int, tmp: Path) -> list[float]:
    os.environ[SPAWN_VAR] = mode
    run_dir = tmp / f"ready-{mode}"
    run_dir.mkdir()
    with Supervisor(run_dir) as sup:
        one_ready(sup, run_dir, -1)  # (the zygote's preload, and the first child's page faults)
        return [one_ready(sup, run_dir, i) for i in range(rounds)]


def main() -> None:
    args = parse_args()
    out: dict[str, Any] = {"machine": machine_info(), "rounds": args.rounds, "workers": args.workers}
    runs: dict[str, list[dict[str, float]]] = {"fork": [], "exec": []}
    for r in range(args.rounds):
        for mode in ("fork", "exec") if r % 2 == 0 else ("exec", "fork"):
            runs[mode].append(one_run(mode, args.workers))
            f = runs[mode][-1]
            print(f"round {r} {mode}: cpu {f['cpu_s']:.2f} s, wall {f['wall_s']:.2f} s, busy {f['busy']:.0%}")
    cpu_ratios = [f["cpu_s"] / e["cpu_s"] for f, e in zip(runs["fork"], runs["exec"])]
    wall_ratios = [f["wall_s"] / e["wall_s"] for f, e in zip(runs["fork"], runs["exec"])]
    for mode, rows in runs.items():
        cpu, wall = [x["cpu_s"] for x in rows], [x["wall_s"] for x in rows]
        print(
            f"run {mode}: cpu median {median(cpu):.2f} s ({min(cpu):.2f}-{max(cpu):.2f}), "
            f"wall median {median(wall):.2f} s ({min(wall):.2f}-{max(wall):.2f})"
        )
    rounded = {k: [round(x, 3) for x in v] for k, v in (("cpu", cpu_ratios), ("wall", wall_ratios))}
    print(f"run fork/exec per round: cpu {rounded['cpu']}, wall {rounded['wall']}")
    with tempfile.TemporaryDirectory() as tmp:
        mods = Path(tmp) / "mods"
        mods.mkdir()
        (mods / "spawn_probe.py").write_text(PROBE)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(mods), os.environ.get("PYTHONPATH", "")])
        busy0 = cpu_jiffies()
        ready = {mode: ready_rounds(mode, args.rounds, Path(tmp)) for mode in ("exec", "fork")}
        ready_busy = cpu_busy(busy0)
    for mode, times in ready.items():
        ms = [t * 1e3 for t in times]
        print(f"ready {mode}: spawn -> imported median {median(ms):.0f} ms ({min(ms):.0f}-{max(ms):.0f})")
    print(f"ready: busy {ready_busy:.0%}; fork/exec {median(ready['fork']) / median(ready['exec']):.3f}")
    out.update(
        runs=runs,
        cpu_ratios=cpu_ratios,
        wall_ratios=wall_ratios,
        ready_s=ready,
        ratio=median(cpu_ratios),
        ratio_name="fork/exec CPU of a whole run",
    )
    if args.json:
        write_json(args.json, out)
    print(f"wall_ratio={median(wall_ratios):.3f}")
    print(f"ratio={median(cpu_ratios):.3f}")


if __name__ == "__main__":
    main()
