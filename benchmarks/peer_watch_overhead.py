"""The no-failure cost of the neighbour watch (``roles/peer_link.py``): the same 2-worker
allreduce job (``examples/tiny.yaml``) with ``cluster.peer_heartbeat_s`` at its default (0.25 s:
a ping every 0.125 s to each ring neighbour) and at 60 s (effectively off), alternating in one
run; the figure is each run's median committed step time (``step_s`` of the metrics records,
the first 100 steps left out), and the last line ``ratio=<on / off>`` of the medians over rounds.

    .venv/bin/python benchmarks/peer_watch_overhead.py --quick    # 3 rounds, about 2 minutes
    .venv/bin/python benchmarks/peer_watch_overhead.py --rounds 7 --steps 3000
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, python, write_json
from flotilla.report.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"on": "0.25", "off": "60"}


def median_step_s(heartbeat_s: str, steps: int, workers: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        cmd = [
            python(),
            "-m",
            "flotilla.cli.main",
            "run",
            "examples/tiny.yaml",
            "--no-progress",
            "--report",
            d,
        ]
        for k, v in {
            "job.steps": steps,
            "job.eval_every_steps": 0,
            "cluster.num_workers": workers,
            "cluster.peer_heartbeat_s": heartbeat_s,
        }.items():
            cmd += ["--set", f"{k}={v}"]
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
        recs = read_jsonl(Path(d) / "metrics.jsonl")
        return statistics.median(
            float(r["step_s"]) for r in recs if r.get("committed") and "step_s" in r and r["step"] > 100
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="the defaults (3 rounds of 1500 steps)")
    ap.add_argument("--json", default=None, help="write every figure here")
    a = ap.parse_args()
    print(f"machine: {machine_info()}", flush=True)
    got: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(a.rounds):
        for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
            got[name].append(median_step_s(SETTINGS[name], a.steps, a.workers))
            print(
                f"round {r} watch {name:3s} (peer_heartbeat_s={SETTINGS[name]}): median step "
                f"{1e3 * got[name][-1]:.3f} ms",
                flush=True,
            )
    on, off = statistics.median(got["on"]), statistics.median(got["off"])
    print(f"median over rounds: watch on {1e3 * on:.3f} ms, off {1e3 * off:.3f} ms")
    if a.json:
        write_json(a.json, {"machine": machine_info(), "median_step_s": got, "ratio": on / off})
    print(f"ratio={on / off:.3f}")


if __name__ == "__main__":
    main()
