"""Benchmark: synchronous SGD step time, flotilla's ``allreduce`` strategy against torch DDP.

Both contenders run in the *same* worker processes (``--world`` of them, gloo on 127.0.0.1, one
intra-op thread each) on the same model (zoo ``mlp``: 2,894,090 parameters for input ``(1024,)``),
the same initial parameters, optimizer (SGD with momentum), synthetic data and bucket size:

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over its own gloo group, mean loss per
  local batch (DDP averages the gradients);
- ``flotilla``: a replica + :class:`flotilla.sync.allreduce.BucketedAllReduce` bound to an
  :class:`flotilla.comm.collective.EpochGroup`, stepped by :func:`flotilla.trainer.step.run_step`
  (the step workers run: bucketed all-reduce during backward, atomic vote, write-back, optimizer).

Each round runs ``K`` timed steps of one contender and then ``K`` of the other, swapping which goes
first every round.  A step is timed on rank 0 with ``time.perf_counter`` around the whole step
(zero_grad, forward, backward, communication, optimizer step); no barrier inside the timed region.
The parent prints the raw figures and, as its last line, ``ratio=<flotilla median / DDP median>``.

Checks (cheap, after the timed run): flotilla replicas are bitwise identical across ranks, and so
are DDP's; flotilla's and DDP's parameters agree to float rounding (same steps, same data).

Run: ``python benchmarks/ssgd_vs_ddp.py --quick`` (under 60 s) or without ``--quick`` (a few
minutes); ``--world 3``, ``--json PATH``, ``--bucket-mb`` and the round sizes are options.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

CONTENDERS = ("ddp", "flotilla")
INPUT_DIM, NUM_CLASSES, MODEL = 1024, 10, "mlp"
QUICK = {"rounds": 16, "steps": 8, "warmup": 5}
FULL = {"rounds": 60, "steps": 10, "warmup": 10}


# ============================================================================ worker process

def _make_batches(rank: int, batch: int, count: int) -> list[tuple[Any, Any]]:
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(batch, INPUT_DIM, generator=gen),
             torch.randint(0, NUM_CLASSES, (batch,), generator=gen)) for _ in range(count)]


class _Contender:
    """One way of running a data-parallel step; ``step`` uses the next batch of ``batches``."""

    def __init__(self, model: Any, step_fn: Callable[[int, Any, Any], float], batches: list) -> None:
        self.model, self._step_fn, self._batches = model, step_fn, batches
        self.num_steps = 0

    def step(self) -> float:
        x, y = self._batches[self.num_steps % len(self._batches)]
        loss = self._step_fn(self.num_steps, x, y)
        self.num_steps += 1
        return loss


def _as_process_group(group: Any, store: Any) -> Any:
    """Wrap the group's gloo *backend* in a ``ProcessGroup``, which is what DDP accepts."""
    import torch
    import torch.distributed as dist

    pg = dist.ProcessGroup(store, group.rank, group.world_size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                         group.process_group)
    pg._set_group_name(f"bench-ddp-epoch{group.epoch}")
    return pg


def _build_ddp(store: Any, a: argparse.Namespace, batches: list) -> tuple[_Contender, Any, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from flotilla.comm.collective import EpochGroup
    from flotilla.models.zoo import build_model

    group = EpochGroup(dist.PrefixStore("ddp/", store), epoch=0, rank=a.rank,
                       world_size=a.world, timeout_s=a.timeout_s)
    model = build_model(MODEL, input_shape=(INPUT_DIM,), num_classes=NUM_CLASSES, seed=0)
    ddp = DDP(model, process_group=_as_process_group(group, store), bucket_cap_mb=a.bucket_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=a.lr, momentum=0.9)

    def step(_k: int, x: Any, y: Any) -> float:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return _Contender(model, step, batches), group, ddp


def _build_flotilla(store: Any, a: argparse.Namespace, batches: list) -> tuple[_Contender, Any, Any]:
    import torch

    from flotilla.comm.collective import EpochGroup
    from flotilla.core.errors import StepAborted
    from flotilla.models.zoo import build_model
    from flotilla.sync.allreduce import BucketedAllReduce
    from flotilla.trainer.step import run_step

    group = EpochGroup(store, epoch=0, rank=a.rank, world_size=a.world, timeout_s=a.timeout_s)
    model = build_model(MODEL, input_shape=(INPUT_DIM,), num_classes=NUM_CLASSES, seed=0)
    sync = BucketedAllReduce(model, bucket_bytes=int(a.bucket_mb * 2**20))
    sync.bind(group)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    global_batch = a.batch * a.world

    def step(k: int, x: Any, y: Any) -> float:
        res = run_step(model, opt, sync, x, y, step=k, global_batch=global_batch)
        if not res.decision.committed:
            raise StepAborted(f"flotilla step {k} was not committed")
        return res.loss

    return _Contender(model, step, batches), group, sync


def _timed(contender: _Contender, num: int) -> list[float]:
    times = []
    for _ in range(num):
        t0 = time.perf_counter()
        contender.step()
        times.append(time.perf_counter() - t0)
    return times


def _ddp_bucket_sizes(model_ddp: Any) -> list[int] | None:
    try:
        data = model_ddp._get_ddp_logging_data()
        text = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
        return [int(s) for s in str(text).split(",") if s.strip()]
    except Exception:  # a private API: informative only
        return None


def _max_abs_diff(m1: Any, m2: Any) -> float:
    pairs = zip(m1.parameters(), m2.parameters())
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in pairs)


def worker_main(a: argparse.Namespace) -> None:
    import torch

    from flotilla.comm.collective import StoreAddress, connect_store
    from flotilla.sync.state import model_digest

    _common.exit_with_parent()
    torch.set_num_threads(a.threads)
    store = connect_store(StoreAddress("127.0.0.1", a.port), timeout_s=a.timeout_s)
    batches = _make_batches(a.rank, a.batch, 4)
    ddp, ddp_group, ddp_wrapper = _build_ddp(store, a, batches)
    flo, flo_group, sync = _build_flotilla(store, a, batches)
    contenders = {"ddp": ddp, "flotilla": flo}
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for name in CONTENDERS:
        _timed(contenders[name], a.warmup)
    for order in _common.alternating_orders(CONTENDERS, a.rounds):
        for name in order:
            flo_group.barrier()                  # start each phase together (not timed)
            _timed(contenders[name], a.phase_warmup)
            times[name].extend(_timed(contenders[name], a.steps))
    flo_group.barrier()
    result = {"rank": a.rank, "times_s": times,
              "digest": {n: model_digest(c.model) for n, c in contenders.items()},
              "num_steps": {n: c.num_steps for n, c in contenders.items()},
              "flotilla_num_buckets": sync.num_buckets,
              "ddp_bucket_sizes": _ddp_bucket_sizes(ddp_wrapper),
              "max_abs_param_diff": _max_abs_diff(flo.model, ddp.model)}
    _common.write_json(Path(a.out_dir) / f"rank{a.rank}.json", result)
    flo_group.barrier()                          # nobody closes while a peer still reduces
    sync.close()
    flo_group.close()
    ddp_group.close()


# ============================================================================ parent process

def _worker_argv(a: argparse.Namespace, rank: int, port: int, out_dir: str) -> list[str]:
    argv = [_common.python(), str(Path(__file__).resolve()), "--worker", "--rank", str(rank),
            "--port", str(port), "--out-dir", out_dir]
    for key in ("world", "rounds", "steps", "warmup", "phase_warmup", "batch", "bucket_mb", "lr",
                "threads", "timeout_s"):
        argv += [f"--{key.replace('_', '-')}", str(getattr(a, key))]
    return argv


def _run_workers(a: argparse.Namespace) -> list[dict]:
    from flotilla.comm.collective import StoreHost

    store = StoreHost("127.0.0.1", 0, timeout_s=a.timeout_s)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    try:
        with tempfile.TemporaryDirectory(prefix="ssgd_vs_ddp-") as out_dir, _common.Children() as kids:
            for rank in range(a.world):
                kids.start(_worker_argv(a, rank, store.address.port, out_dir), env=env)
            codes = kids.wait_all(timeout_s=a.deadline_s)
            if any(codes):
                raise SystemExit(f"ssgd_vs_ddp: worker exit codes {codes}")
            return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(a.world)]
    finally:
        store.close()


def _paired_ratio(times: dict[str, list[float]], steps: int) -> dict[str, float]:
    """Per round, flotilla's median over DDP's (the two ran back to back); summarised over rounds."""
    f, d = times["flotilla"], times["ddp"]
    ratios = [_common.median(f[i:i + steps]) / _common.median(d[i:i + steps])
              for i in range(0, len(f), steps)]
    return _common.summarize(ratios)


def _report(a: argparse.Namespace, results: list[dict], wall_s: float) -> tuple[dict, bool]:
    from flotilla.models.zoo import build_model, count_parameters

    r0 = results[0]
    stats = {n: _common.summarize([t * 1e3 for t in r0["times_s"][n]]) for n in CONTENDERS}
    per_rank_median_ms = {n: [_common.median(r["times_s"][n]) * 1e3 for r in results]
                          for n in CONTENDERS}
    digests = {n: [r["digest"][n] for r in results] for n in CONTENDERS}
    same = {n: len(set(d)) == 1 for n, d in digests.items()}
    max_diff = max(r["max_abs_param_diff"] for r in results)
    paired = _paired_ratio(r0["times_s"], a.steps)
    agree = max_diff <= a.agree_tol
    params = count_parameters(build_model(MODEL, input_shape=(INPUT_DIM,), num_classes=NUM_CLASSES))
    figures = {
        "benchmark": "ssgd_vs_ddp", "model": MODEL, "num_params": params, "world": a.world,
        "backend": "gloo", "batch_per_worker": a.batch, "bucket_bytes": int(a.bucket_mb * 2**20),
        "rounds": a.rounds, "steps_per_round": a.steps, "warmup_steps": a.warmup,
        "phase_warmup_steps": a.phase_warmup, "threads_per_worker": a.threads, "quick": a.quick,
        "step_ms_rank0": stats, "median_step_ms_per_rank": per_rank_median_ms,
        "raw_step_s_rank0": r0["times_s"],
        "flotilla_num_buckets": r0["flotilla_num_buckets"],
        "ddp_bucket_sizes": r0["ddp_bucket_sizes"],
        "digests": digests, "digests_equal": same, "max_abs_param_diff_flotilla_vs_ddp": max_diff,
        "paired_round_ratio": paired,
        "ratio": stats["flotilla"]["median"] / stats["ddp"]["median"],
        "wall_s": wall_s, "machine": _common.machine_info(),
    }
    return figures, all(same.values()) and agree


def _print(f: dict, ok: bool) -> None:
    m = f["machine"]
    print(f"ssgd_vs_ddp: {f['model']} ({f['num_params']:,} params), world {f['world']}, gloo on "
          f"127.0.0.1, batch {f['batch_per_worker']}/worker, SGD momentum 0.9, "
          f"{f['threads_per_worker']} thread/worker")
    print(f"bucket: {f['bucket_bytes']:,} bytes ({f['bucket_bytes'] / 2**20:g} MiB) for both; "
          f"flotilla buckets {f['flotilla_num_buckets']}, DDP bucket sizes {f['ddp_bucket_sizes']}")
    print(f"schedule: {f['warmup_steps']} warm-up steps each, then {f['rounds']} rounds x "
          f"{f['steps_per_round']} timed steps per contender (+{f['phase_warmup_steps']} untimed "
          f"per phase), order swapped every round")
    print(f"machine: {m['cpu_model']}, nproc {m['nproc']}, torch {m['torch']}, python "
          f"{m['python']}, loadavg {m.get('loadavg_1m', float('nan')):.2f}")
    print(f"{'contender':<10} {'median_ms':>10} {'p10_ms':>8} {'p90_ms':>8} {'min_ms':>8} "
          f"{'steps':>6}  per-rank medians")
    for n in CONTENDERS:
        s = f["step_ms_rank0"][n]
        ranks = " ".join(f"{v:.2f}" for v in f["median_step_ms_per_rank"][n])
        print(f"{n:<10} {s['median']:>10.2f} {s['p10']:>8.2f} {s['p90']:>8.2f} {s['min']:>8.2f} "
              f"{s['n']:>6}  {ranks}")
    d = f["digests"]
    print(f"check: flotilla digests equal across ranks: {f['digests_equal']['flotilla']} "
          f"({d['flotilla'][0]}); ddp: {f['digests_equal']['ddp']}; "
          f"max |w_flotilla - w_ddp| = {f['max_abs_param_diff_flotilla_vs_ddp']:.2e}"
          f"{'' if ok else '  CHECK FAILED'}")
    pr = f["paired_round_ratio"]
    print(f"per-round flotilla/DDP ratio (drift check): median {pr['median']:.3f}, "
          f"p10 {pr['p10']:.3f}, p90 {pr['p90']:.3f} over {pr['n']} rounds")
    print(f"wall: {f['wall_s']:.1f} s")
    print(f"ratio={f['ratio']:.3f}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"short schedule {QUICK} (< 60 s)")
    p.add_argument("--world", type=int, default=2, choices=(2, 3), help="worker processes")
    p.add_argument("--rounds", type=int, help=f"alternation rounds (default {FULL['rounds']}; quick {QUICK['rounds']})")
    p.add_argument("--steps", type=int, help=f"timed steps per contender per round (default {FULL['steps']}; quick {QUICK['steps']})")
    p.add_argument("--warmup", type=int, help=f"untimed steps per contender first (default {FULL['warmup']}; quick {QUICK['warmup']})")
    p.add_argument("--phase-warmup", type=int, default=0, help="untimed steps at the start of each phase")
    p.add_argument("--batch", type=int, default=64, help="samples per worker per step")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="bucket size in MiB, both contenders")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    p.add_argument("--timeout-s", type=float, default=60.0, help="store/collective timeout")
    p.add_argument("--deadline-s", type=float, default=900.0, help="whole-run limit")
    p.add_argument("--agree-tol", type=float, default=1e-3,
                   help="max |w_flotilla - w_ddp| accepted by the check")
    p.add_argument("--json", metavar="PATH", help="write all figures to this JSON file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    preset = QUICK if a.quick else FULL
    for key, value in preset.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    for key in ("rounds", "steps", "batch", "threads"):
        if getattr(a, key) < 1:
            p.error(f"--{key} must be >= 1")
    if a.warmup < 1 or a.phase_warmup < 0 or a.bucket_mb <= 0:
        p.error("--warmup must be >= 1 (DDP rebuilds its buckets on the first step), "
                "--phase-warmup >= 0, --bucket-mb > 0")
    return a


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    if a.worker:
        worker_main(a)
        return 0
    t0 = time.perf_counter()
    results = _run_workers(a)
    figures, ok = _report(a, results, time.perf_counter() - t0)
    if a.json:
        _common.write_json(a.json, figures)
    _print(figures, ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
