"""Every strategy with lost, duplicated, delayed and reordered control messages (issue 37 item 4).

Each round runs, for every strategy, the same small job twice -- once clean, once with
``FLOTILLA_NET_FAULTS`` (``comm/faulty.py``: ``--rate`` of each fault -- a request lost,
duplicated, delayed, reordered; a reply lost -- 10 % by default, on the coordinator's control
ops; and every liveness connection reset by the network with ``--liveness-reset`` per 0.5-s
poll, 10 % by default: a live peer must not be taken for dead; with ``--collective-reset P``,
every collective or send launched on a group of two or more also finds the group's connections
reset by the network with probability P, 0 by default) -- alternating which goes first,
and prints per strategy: completed runs, the median over rounds of the per-round throughput
ratio (faulty over clean samples/s of committed steps between the first and the last one; the
goal is >= 0.7, reported, not a gate), the wall-time ratio (start-up and shutdown included: a
lost join or finish reply costs a retry's
timeout there) and the checks below, for both runs:

- ``completed``: ``flotilla run`` exited 0 and the summary says ``completed``;
- ``once``: no worker committed a step twice (the records' ``(worker_id, step)`` pairs are unique),
  and no worker was lost to a fault (``members_lost`` empty);
- ``atomic`` (strategies whose replicas are equal after every step: ``allreduce``): every step's
  parameter digests agree across the workers.

    .venv/bin/python benchmarks/message_faults.py --quick            # 1 round, 200 steps
    .venv/bin/python benchmarks/message_faults.py --rounds 3 --json out.json

The machine's load is printed (CPU busy share during each run): figures from a busy machine
measure contention, not the protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import alternating_orders, cpu_busy, cpu_jiffies, machine_info, median, write_json
from flotilla.comm.faulty import NetFaults

ROOT = Path(__file__).resolve().parents[1]
# the coordinator's control ops (data-parallel strategies) and a pipeline host's (a pipeline's and
# HetPipe's stages join, beat, report their weights, result or failure through it)
CONTROL_OPS = ("heartbeat", "poll_view", "get_view", "suspect", "leave", "join", "finish")
STAGE_OPS = ("stage_join", "stage_beat", "stage_weights", "stage_result", "stage_failed")
SPEED = 0.2  # devices emulated 5x slower than the host: a few seconds of training per run
_PIPE = {"num_stages": 2, "num_microbatches": 4, "step_timeout_s": 20.0}
STRATEGIES: dict[str, dict[str, Any]] = {
    "allreduce": {"kind": "allreduce", "step_timeout_s": 10.0},
    "partial_reduce": {"kind": "partial_reduce", "group_size": 2},
    "adpsgd": {"kind": "adpsgd"},
    "diloco": {"kind": "diloco", "inner_steps": 10},
    "ps": {"kind": "ps"},
    "gpipe": {"kind": "pipeline", "schedule": "gpipe", **_PIPE},
    "1f1b": {"kind": "pipeline", "schedule": "1f1b", **_PIPE},
    "pipedream": {"kind": "pipeline", "schedule": "pipedream", **_PIPE},
    # HetPipe's smallest mixed cluster: one device holds the model, two hold it only together
    "hetpipe": {
        "kind": "hetpipe",
        "placement": "np",
        "s_local": 1,
        "clock_distance": 0,
        "step_timeout_s": 20.0,
    },
}
REPLICATED = {"allreduce"}  # every step's digests must agree
PIPELINED = {"pipeline", "hetpipe"}  # kinds whose stages report through a pipeline host


def _config(strategy: dict[str, Any], steps: int) -> dict[str, Any]:
    cluster: dict[str, Any] = {"num_workers": 3, "host": "127.0.0.1", "defaults": {"speed": SPEED}}
    job: dict[str, Any] = {
        "model": {"name": "tiny_mlp"},
        "dataset": {"name": "synthetic", "num_samples": 2000, "test_fraction": 0.2},
        "optimizer": {"kind": "sgd", "lr": 0.1, "momentum": 0.9},
        "batch_size": 64,
    }
    if strategy["kind"] == "pipeline":  # a fast and a half-speed device, one stage each
        cluster = {"host": "127.0.0.1", "workers": [_dev("fast", 1.0, 64), _dev("slow", 0.5, 64)]}
    if strategy["kind"] == "hetpipe":
        cluster = {
            "host": "127.0.0.1",
            "workers": [_dev("a0", 1, 64, "n0"), *(_dev(n, 1, 5, "n1") for n in ("b0", "b1"))],
        }
    if strategy["kind"] in PIPELINED:  # a model with layers to split: a char transformer
        job = {
            "model": {"name": "char_transformer", "width": 32},
            "dataset": {"name": "pysource", "num_samples": 2000, "test_fraction": 0.2},
            "optimizer": {"kind": "adam", "lr": 0.003},
            "batch_size": 16,
        }
    return {
        "cluster": cluster,
        "job": {**job, "steps": steps, "seed": 0, "eval_every_steps": 0},
        "strategy": strategy,
        "report": {"metrics_every_steps": 1, "digest_every_steps": 1, "trackers": []},
    }


def _dev(name: str, speed: float, mib: int, node: str | None = None) -> dict[str, Any]:
    """One emulated device ``speed`` times :data:`SPEED` fast, with ``mib`` MiB of memory."""
    return {
        "name": name,
        "speed": SPEED * speed,
        "memory_bytes": f"{mib}MiB",
        **({"node": node} if node else {}),
    }


def _trained(record: dict[str, Any]) -> bool:
    """A record of a committed step: a data-parallel worker's ``committed`` step; a pipeline's
    step as its last stage reports it (the one that holds the loss)."""
    if "stage_idx" in record:
        return record.get("loss") is not None and "step" in record
    return bool(record.get("committed")) and "step" in record


def _run(name: str, faults: NetFaults | None, steps: int, work: Path, tag: str) -> dict[str, Any]:
    cfg_path, report = work / f"{tag}.json", work / tag
    cfg_path.write_text(json.dumps(_config(STRATEGIES[name], steps)))
    env = dict(os.environ)
    if faults is not None:
        env["FLOTILLA_NET_FAULTS"] = faults.to_json()
    cmd = [sys.executable, "-m", "flotilla.cli.main", "run", str(cfg_path), "--report", str(report)]
    cmd += ["--run-dir", str(work / f"{tag}-run"), "--no-progress"]
    t0, cpu0 = time.monotonic(), cpu_jiffies()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    wall, busy = time.monotonic() - t0, cpu_busy(cpu0)
    summary = json.loads((report / "summary.json").read_text()) if (report / "summary.json").exists() else {}
    records = []
    if (report / "metrics.jsonl").exists():
        records = [json.loads(line) for line in (report / "metrics.jsonl").read_text().splitlines() if line]
    committed = [(r.get("worker_id"), r["step"]) for r in records if _trained(r)]
    twice = [k for k, n in Counter(committed).items() if n > 1]
    digests: dict[int, set[str]] = defaultdict(set)
    for r in records:
        if r.get("committed") and r.get("digest"):
            digests[int(r["step"])].add(r["digest"])
    split = [s for s, d in digests.items() if len(d) > 1]
    completed = out.returncode == 0 and bool(summary.get("completed"))
    trained = [r for r in records if _trained(r) and "time_s" in r]
    span = max(r["time_s"] for r in trained) - min(r["time_s"] for r in trained) if trained else 0.0
    lost = [
        str(e.get("reason") or e.get("why") or e)[-300:]
        for k in ("members_lost", "instances_lost", "restarts")
        for e in summary.get(k) or []
    ]
    return {
        "completed": completed,
        "once": not twice and not lost,
        "lost": lost + [f"{len(twice)} (worker, step) committed twice"] * bool(twice),
        "atomic": (not split and bool(digests)) if name in REPLICATED else None,
        # samples of committed steps over the time between the first and the last one: the
        # training's rate, without start-up and shutdown (a lost join or finish reply costs those
        # a retry's timeout, counted in wall_s)
        "samples_per_s": sum(int(r.get("samples", 0)) for r in trained) / span if span > 0 else 0.0,
        "wall_s": round(wall, 2),
        "cpu_busy": round(busy, 2),
        "error": "" if completed else (out.stderr.strip().splitlines() or ["?"])[-1][:300],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round of 120 steps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--rate", type=float, default=0.1, help="probability of each fault per message")
    ap.add_argument(
        "--liveness-reset",
        type=float,
        default=0.1,
        help="probability that the network resets a liveness connection, per connection and poll (0.5 s)",
    )
    ap.add_argument(
        "--collective-reset",
        type=float,
        default=0.0,
        help="probability that the network resets a collective group's connections, per launch",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--strategies", nargs="*", default=list(STRATEGIES), choices=list(STRATEGIES))
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    rounds, steps = (1, 200) if a.quick else (a.rounds, a.steps)
    t_start = time.monotonic()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        s: {"clean": [], "faults": []} for s in a.strategies
    }
    with tempfile.TemporaryDirectory(prefix="flotilla-msgfaults-") as tmp:
        work = Path(tmp)
        for r in range(rounds):
            for name in a.strategies:
                for mode in alternating_orders(["clean", "faults"], rounds)[r]:
                    p = a.rate
                    faults = (
                        NetFaults(
                            drop=p,
                            duplicate=p,
                            delay=p,
                            reorder=p,
                            lose_reply=p,
                            delay_s=0.05,
                            liveness_reset=a.liveness_reset,
                            collective_reset=a.collective_reset,
                            seed=a.seed + r,
                            ops=CONTROL_OPS + STAGE_OPS,
                        )
                        if mode == "faults"
                        else None
                    )
                    got = _run(name, faults, steps, work, f"{name}-{mode}-{r}")
                    results[name][mode].append(got)
                    print(f"round {r} {name:14s} {mode:6s} {json.dumps(got)}", flush=True)
    print(f"machine: {machine_info()}; wall {time.monotonic() - t_start:.1f} s")
    print(f"{'strategy':14s} completed(clean/faults)  once  atomic  median_ratio  wall_ratio  ratios")
    table = {}
    for name, runs in results.items():
        ratios = [
            f["samples_per_s"] / c["samples_per_s"]
            for c, f in zip(runs["clean"], runs["faults"])
            if c["completed"] and f["completed"] and c["samples_per_s"] > 0
        ]
        both = runs["clean"] + runs["faults"]
        row = {
            "completed_clean": sum(x["completed"] for x in runs["clean"]),
            "completed_faults": sum(x["completed"] for x in runs["faults"]),
            "once": all(x["once"] for x in both),
            "atomic": None if name not in REPLICATED else all(x["atomic"] for x in both),
            "median_ratio": median(ratios) if ratios else float("nan"),
            "wall_ratio": median([f["wall_s"] / c["wall_s"] for c, f in zip(runs["clean"], runs["faults"])]),
            "ratios": [round(x, 3) for x in ratios],
        }
        table[name] = row
        print(
            f"{name:14s} {row['completed_clean']}/{rounds} {row['completed_faults']}/{rounds}"
            f"{'':14s}{str(row['once']):5s} {str(row['atomic']):6s}  {row['median_ratio']:.3f}"
            f"         {row['wall_ratio']:.2f}"
            f"        {row['ratios']}"
        )
    if a.json:
        write_json(a.json, {"args": vars(a), "machine": machine_info(), "table": table, "runs": results})
    ok = all(
        r["completed_faults"] == rounds and r["once"] and r["atomic"] is not False for r in table.values()
    )
    print("all completed with the checks intact" if ok else "SOME RUN FAILED A CHECK (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
