"""A step after the speed emulator's sleep, against one in a tight loop (session 32, issue 35).

Each process times ``examples/partial_reduce.yaml``'s training step (its model at a 32-sample
batch, one intra-op thread) ``--steps`` times; with a ``speed`` below 1 each step is followed by a
sleep of ``(1 / speed - 1)`` times its compute, as ``cluster/emulation.SpeedEmulator`` does.  The
time a step waited for a core (``/proc/thread-self/schedstat``) is subtracted, so several
processes at once measure the sleep's effect, not their contention.  Printed per case: the
median own step time of each process; last line ``ratio=<speed 0.25 / tight loop>`` (one
process).

    python benchmarks/emulation_sleep.py [--json out.json]      # ~10 s on the 2-core VM

A measurement of the emulation itself, not a contender against a baseline: the tight loop is
the reference every case is read against.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, write_json

ROOT = Path(__file__).resolve().parents[1]
CASES = ((1, 1.0), (1, 0.5), (1, 0.25), (1, 0.083), (2, 1.0), (2, 0.25), (4, 1.0), (4, 0.25))


def _work(steps: int, speed: float, out: mp.Queue) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    from flotilla.cluster.emulation import run_queue_wait_s
    from flotilla.config import load_config
    from flotilla.trainer import builders

    torch.set_num_threads(1)
    cfg = load_config(ROOT / "examples" / "partial_reduce.yaml", [])
    task = builders.build_task(cfg)
    model = builders.build_task_model(cfg, task)
    train, _ = builders.build_task_data(task)
    opt = builders.build_optimizer(cfg, model)
    x, y = train.batch(list(range(32)))
    own = []
    for _ in range(steps):
        waited, t0 = run_queue_wait_s(), time.perf_counter()
        opt.zero_grad()
        task.loss(model(x), y).backward()
        opt.step()
        took = time.perf_counter() - t0
        own.append(took - (run_queue_wait_s() - waited))
        if speed < 1:
            time.sleep(took * (1 / speed - 1))
    out.put(statistics.median(own[20:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if a.steps < 40:
        ap.error("--steps: at least 40 (the first 20 of each process are not counted)")
    ctx = mp.get_context("spawn")
    alone: dict[float, float] = {}
    rows = []
    for n, speed in CASES:
        q = ctx.Queue()
        procs = [ctx.Process(target=_work, args=(a.steps, speed, q)) for _ in range(n)]
        for p in procs:
            p.start()
        got = [q.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
        if n == 1:
            alone[speed] = got[0]
        rows.append({"processes": n, "speed": speed, "own_step_s": got})
        shown = ", ".join(f"{1e3 * g:.2f}" for g in got)
        print(
            f"{n} process(es), speed {speed:g}: own step {1e3 * statistics.median(got):.2f} ms ({shown})",
            flush=True,
        )
    ratio = alone[0.25] / alone[1.0]
    if a.json:
        write_json(a.json, {"rows": rows, "ratio": ratio, "machine": machine_info(), "steps": a.steps})
    print(f"ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
