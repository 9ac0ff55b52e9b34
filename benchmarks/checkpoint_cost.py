"""The cost of the default checkpoints (``job.auto_checkpoint``, docs/checkpoints.md): the same job
with them on and off, alternating within each round, in one run.

- ``allreduce``: ``examples/tiny.yaml`` (2 workers, emulated speed ``--speed``), checkpoints
  every 10 s into ``<report>/checkpoints`` (the 2 newest kept) when on;
- ``pipeline``: ``examples/pipeline_lm.yaml`` (2 stages, 1F1B, a character transformer), every
  stage checkpoints every 10 steps when on.

Figure per run: seconds per step over the training span (first to last step record of
``metrics.jsonl``, every worker or stage), so the checkpoint writes between steps are inside it;
per kind the median over rounds, and ``ratio_<kind>=<on / off>`` (1.0: free; 1.05: 5 % slower).
The last line is ``ratio=`` the larger (worse) of the two.  Each run's checkpoints written are
printed (the allreduce job must outlast the 10 s cadence for its figure to mean anything).

On a contended machine the end-to-end ratio drowns in noise, so one checkpoint write is also
timed directly (``write_ms_<kind>``: the whole model and two Adam-sized optimizer tensors per
parameter through ``elastic.checkpoint.write_checkpoint``, fsyncs included, median of 7), with
the overhead it implies at the default cadence (``implied_<kind>``: write / 10 s for allreduce;
write / (10 x the median step with checkpoints off) for the pipeline, an upper bound since each
stage writes only its own layers, in parallel).

    .venv/bin/python benchmarks/checkpoint_cost.py --quick     # 3 rounds, short jobs
    .venv/bin/python benchmarks/checkpoint_cost.py --rounds 5 --json runs/checkpoint_cost.json
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, python, write_json
from flotilla.report.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
QUICK = {"rounds": 3, "allreduce_steps": 800, "pipeline_steps": 60}
FULL = {"rounds": 5, "allreduce_steps": 1500, "pipeline_steps": 200}


def _sets(kind: str, a: argparse.Namespace, on: bool) -> dict[str, Any]:
    common = {"job.auto_checkpoint": str(on).lower(), "job.eval_every_steps": 0}
    if kind == "allreduce":
        return {**common, "job.steps": a.allreduce_steps, "cluster.defaults.speed": a.speed}
    return {**common, "job.steps": a.pipeline_steps, "job.dataset.num_samples": 4000}


def _count_checkpoints(report: Path) -> int:
    root = report / "checkpoints"
    if not root.is_dir():
        return 0
    return len({p.name for p in root.rglob("ckpt-*") if p.is_dir()})


def run_once(kind: str, a: argparse.Namespace, on: bool) -> tuple[float, int]:
    """(seconds per step over the training span, checkpoints found) of one run."""
    config = "examples/tiny.yaml" if kind == "allreduce" else "examples/pipeline_lm.yaml"
    with tempfile.TemporaryDirectory() as d:
        cmd = [python(), "-m", "flotilla.cli.main", "run", config, "--no-progress", "--report", d]
        for k, v in _sets(kind, a, on).items():
            cmd += ["--set", f"{k}={v}"]
        out = subprocess.run(cmd, capture_output=True, cwd=ROOT, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{kind} run failed ({out.returncode}): {out.stderr[-2000:]}")
        recs = [r for r in read_jsonl(Path(d) / "metrics.jsonl") if r.get("kind") != "eval" and "step" in r]
        times = [float(r["time_s"]) for r in recs]
        steps = max(int(r["step"]) for r in recs) - min(int(r["step"]) for r in recs)
        return (max(times) - min(times)) / max(1, steps), _count_checkpoints(Path(d))


def write_ms(kind: str, a: argparse.Namespace) -> float:
    """Median milliseconds of one checkpoint write of ``kind``'s whole model (module doc)."""
    import time

    import torch

    from flotilla.config import load_config
    from flotilla.elastic.checkpoint import write_checkpoint
    from flotilla.trainer import builders

    config = "examples/tiny.yaml" if kind == "allreduce" else "examples/pipeline_lm.yaml"
    cfg = load_config(ROOT / config, [f"{k}={v}" for k, v in _sets(kind, a, True).items()])
    model = builders.build_task_model(cfg, builders.build_task(cfg))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optim = {f"t{i}": torch.zeros_like(v) for i, v in enumerate(list(state.values()) * 2)}
    times = []
    with tempfile.TemporaryDirectory() as d:
        for step in range(1, 8):
            t0 = time.perf_counter()
            parts = {"model": state, "optim": optim}
            write_checkpoint(d, step=step, parts=parts, meta={"step": step}, fingerprint="bench", keep=2)
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{QUICK}")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--allreduce-steps", type=int, default=None)
    ap.add_argument("--pipeline-steps", type=int, default=None)
    ap.add_argument("--speed", type=float, default=0.05, help="the allreduce workers' emulated speed")
    ap.add_argument("--kinds", default="allreduce,pipeline")
    ap.add_argument("--json", default=None, help="write every figure here")
    a = ap.parse_args()
    for key, value in (QUICK if a.quick else FULL).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    kinds = a.kinds.split(",")
    print(f"machine: {machine_info()}", flush=True)
    got: dict[str, dict[str, list[float]]] = {k: {"on": [], "off": []} for k in kinds}
    for r in range(a.rounds):
        for kind in kinds:
            for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
                per_step, ckpts = run_once(kind, a, name == "on")
                got[kind][name].append(per_step)
                print(
                    f"round {r} {kind:9s} checkpoints {name:3s}: {1e3 * per_step:8.3f} ms/step "
                    f"({ckpts} checkpoint(s) on disk)",
                    flush=True,
                )
    ratios, implied, writes = {}, {}, {}
    for kind in kinds:
        on, off = statistics.median(got[kind]["on"]), statistics.median(got[kind]["off"])
        ratios[kind] = on / off
        writes[kind] = write_ms(kind, a)
        period_s = 10.0 if kind == "allreduce" else 10 * off  # the default cadence, in seconds
        implied[kind] = writes[kind] / 1e3 / period_s
        print(f"{kind}: median over rounds on {1e3 * on:.3f} ms/step, off {1e3 * off:.3f} ms/step")
        print(f"write_ms_{kind}={writes[kind]:.2f} implied_{kind}={100 * implied[kind]:.2f}%")
        print(f"ratio_{kind}={ratios[kind]:.3f}")
    if a.json:
        figures = {"seconds_per_step": got, "ratios": ratios, "write_ms": writes, "implied": implied}
        write_json(a.json, {"machine": machine_info(), **figures})
    print(f"ratio={max(ratios.values()):.3f}")


if __name__ == "__main__":
    main()
