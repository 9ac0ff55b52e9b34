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
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

CONTENDERS = ("ddp", "flotilla")
INPUT_DIM, NUM_CLASSES, MODEL = 1024, 10, "mlp"
QUICK = {"rounds": 16, "steps": 8, "warmup": 5, "budget_s": 15.0}
FULL = {"rounds": 100, "steps": 10, "warmup": 10, "budget_s": 0.0}


# ============================================================================ worker process


def _make_batches(rank: int, batch: int, count: int) -> list[tuple[Any, Any]]:
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    return [
        (torch.randn(batch, INPUT_DIM, generator=gen), torch.randint(0, NUM_CLASSES, (batch,), generator=gen))
        for _ in range(count)
    ]


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
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, group.process_group)
    pg._set_group_name(f"bench-ddp-epoch{group.epoch}")
    return pg


def _build_ddp(store: Any, a: argparse.Namespace, batches: list) -> tuple[_Contender, Any, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from flotilla.comm.collective import EpochGroup
    from flotilla.models.zoo import build_model

    group = EpochGroup(
        dist.PrefixStore("ddp/", store), epoch=0, rank=a.rank, world_size=a.world, timeout_s=a.timeout_s
    )
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
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    sync = BucketedAllReduce(model, bucket_bytes=int(a.bucket_mb * 2**20), optimizer=opt)
    sync.bind(group)
    global_batch = a.batch * a.world

    def step(k: int, x: Any, y: Any) -> float:
        res = run_step(model, sync, x, y, step=k, global_batch=global_batch)
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


def _stop_agreed(group: Any, stop: bool) -> bool:
    """A barrier that also carries rank 0's 'time is up' decision to every rank."""
    import torch

    flag = torch.tensor([1.0 if stop else 0.0])
    group.allreduce(flag, op="max")
    return bool(flag.item() > 0)


def _measure(contenders: dict[str, _Contender], group: Any, a: argparse.Namespace) -> dict:
    """Warm up, then alternate timed phases; stops early (after an even round) past the budget."""
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for name in CONTENDERS:
        _timed(contenders[name], a.warmup)
    t0, rounds_done = time.perf_counter(), 0
    for r, order in enumerate(_common.alternating_orders(CONTENDERS, a.rounds)):
        over = a.budget_s > 0 and time.perf_counter() - t0 > a.budget_s
        for i, name in enumerate(order):
            stop = _stop_agreed(group, a.rank == 0 and over and r >= 2 and r % 2 == 0 and i == 0)
            if stop:
                return {"times_s": times, "rounds_done": rounds_done}
            _timed(contenders[name], a.phase_warmup)
            times[name].extend(_timed(contenders[name], a.steps))
        rounds_done += 1
    return {"times_s": times, "rounds_done": rounds_done}


def worker_main(a: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    import torch

    from flotilla.comm.store import StoreAddress, connect_store
    from flotilla.models.zoo import count_parameters
    from flotilla.sync.state import model_digest

    _common.exit_with_parent()
    torch.set_num_threads(a.threads)
    store = connect_store(StoreAddress("127.0.0.1", a.port), timeout_s=a.timeout_s)
    batches = _make_batches(a.rank, a.batch, 4)
    ddp, ddp_group, ddp_wrapper = _build_ddp(store, a, batches)
    flo, flo_group, sync = _build_flotilla(store, a, batches)
    contenders = {"ddp": ddp, "flotilla": flo}
    setup_s = time.perf_counter() - t_start
    result = _measure(contenders, flo_group, a)
    flo_group.barrier()
    result.update(
        {
            "rank": a.rank,
            "setup_s": setup_s,
            "num_params": count_parameters(flo.model),
            "digest": {n: model_digest(c.model) for n, c in contenders.items()},
            "num_steps": {n: c.num_steps for n, c in contenders.items()},
            "flotilla_num_buckets": sync.num_buckets,
            "ddp_bucket_sizes": _ddp_bucket_sizes(ddp_wrapper),
            "max_abs_param_diff": _max_abs_diff(flo.model, ddp.model),
        }
    )
    _common.write_json(Path(a.out_dir) / f"rank{a.rank}.json", result)
    flo_group.barrier()  # nobody closes while a peer still reduces
    sync.close()
    flo_group.close()
    ddp_group.close()


# ============================================================================ parent process


def _worker_argv(a: argparse.Namespace, rank: int, port: int, out_dir: str) -> list[str]:
    argv = [
        _common.python(),
        str(Path(__file__).resolve()),
        "--worker",
        "--rank",
        str(rank),
        "--port",
        str(port),
        "--out-dir",
        out_dir,
    ]
    for key in (
        "world",
        "rounds",
        "steps",
        "warmup",
        "phase_warmup",
        "batch",
        "bucket_mb",
        "lr",
        "threads",
        "timeout_s",
        "budget_s",
    ):
        argv += [f"--{key.replace('_', '-')}", str(getattr(a, key))]
    return argv


def _run_workers(a: argparse.Namespace) -> list[dict]:
    from flotilla.comm.store import StoreHost

    store = StoreHost("127.0.0.1", 0, timeout_s=a.timeout_s)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    try:
        with tempfile.TemporaryDirectory(prefix="ssgd_vs_ddp-") as tmp, _common.Children() as kids:
            for rank in range(a.world):
                kids.start(_worker_argv(a, rank, store.address.port, tmp), env=env)
            codes = kids.wait_all(timeout_s=a.deadline_s)
            if any(codes):
                raise SystemExit(
                    f"ssgd_vs_ddp: a worker failed; exit codes by rank {codes} "
                    "(None: still running, now stopped)"
                )
            return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(a.world)]
    finally:
        store.close()


def _paired_ratio(times: dict[str, list[float]], steps: int) -> dict[str, float]:
    """Per round, flotilla's median over DDP's (run back to back); summarised over the rounds."""
    f, d = times["flotilla"], times["ddp"]
    ratios = [
        _common.median(f[i : i + steps]) / _common.median(d[i : i + steps]) for i in range(0, len(f), steps)
    ]
    return _common.summarize(ratios)


def _checks(a: argparse.Namespace, results: list[dict]) -> dict[str, Any]:
    digests = {n: [r["digest"][n] for r in results] for n in CONTENDERS}
    same = {n: len(set(d)) == 1 for n, d in digests.items()}
    max_diff = max(r["max_abs_param_diff"] for r in results)
    return {
        "digests": digests,
        "digests_equal": same,
        "max_abs_param_diff_flotilla_vs_ddp": max_diff,
        "ok": all(same.values()) and max_diff <= a.agree_tol,
    }


def _report(a: argparse.Namespace, results: list[dict], wall_s: float) -> dict[str, Any]:
    """Every figure of the run, as printed and as written by ``--json``."""
    r0 = results[0]
    stats = {n: _common.summarize([t * 1e3 for t in r0["times_s"][n]]) for n in CONTENDERS}
    return {
        "benchmark": "ssgd_vs_ddp",
        "model": MODEL,
        "num_params": r0["num_params"],
        "world": a.world,
        "backend": "gloo",
        "batch_per_worker": a.batch,
        "bucket_bytes": int(a.bucket_mb * 2**20),
        "optimizer": f"SGD(lr={a.lr:g}, momentum=0.9)",
        "rounds": r0["rounds_done"],
        "rounds_asked": a.rounds,
        "budget_s": a.budget_s,
        "steps_per_round": a.steps,
        "warmup_steps": a.warmup,
        "phase_warmup_steps": a.phase_warmup,
        "threads_per_worker": a.threads,
        "quick": a.quick,
        "step_ms_rank0": stats,
        "median_step_ms_per_rank": {
            n: [_common.median(r["times_s"][n]) * 1e3 for r in results] for n in CONTENDERS
        },
        "paired_round_ratio": _paired_ratio(r0["times_s"], a.steps),
        "raw_step_s_rank0": r0["times_s"],
        "flotilla_num_buckets": r0["flotilla_num_buckets"],
        "ddp_bucket_sizes": r0["ddp_bucket_sizes"],
        "worker_setup_s": [r["setup_s"] for r in results],
        "check": _checks(a, results),
        "ratio": stats["flotilla"]["median"] / stats["ddp"]["median"],
        "wall_s": wall_s,
        "machine": _common.machine_info(),
    }


def _print(f: dict) -> None:
    m, c = f["machine"], f["check"]
    print(
        f"ssgd_vs_ddp: {f['model']} ({f['num_params']:,} params), world {f['world']}, gloo on "
        f"127.0.0.1, batch {f['batch_per_worker']}/worker, {f['optimizer']}, "
        f"{f['threads_per_worker']} thread/worker"
    )
    print(
        f"bucket: {f['bucket_bytes']:,} bytes ({f['bucket_bytes'] / 2**20:g} MiB) for both; "
        f"flotilla buckets {f['flotilla_num_buckets']}, DDP bucket sizes {f['ddp_bucket_sizes']}"
    )
    early = f" (stopped at the {f['budget_s']:g} s budget)" if f["rounds"] < f["rounds_asked"] else ""
    print(
        f"schedule: {f['warmup_steps']} warm-up steps each, then {f['rounds']} rounds{early} x "
        f"{f['steps_per_round']} timed steps per contender (+{f['phase_warmup_steps']} untimed "
        f"per phase), order swapped every round; timed on rank 0"
    )
    print(
        f"machine: {m['cpu_model']}, nproc {m['nproc']}, torch {m['torch']}, python "
        f"{m['python']}, loadavg {m.get('loadavg_1m', float('nan')):.2f}"
    )
    print(
        f"{'contender':<10} {'median_ms':>10} {'p10_ms':>8} {'p90_ms':>8} {'min_ms':>8} "
        f"{'steps':>6}  per-rank medians"
    )
    for n in CONTENDERS:
        s = f["step_ms_rank0"][n]
        ranks = " ".join(f"{v:.2f}" for v in f["median_step_ms_per_rank"][n])
        print(
            f"{n:<10} {s['median']:>10.2f} {s['p10']:>8.2f} {s['p90']:>8.2f} {s['min']:>8.2f} "
            f"{s['n']:>6}  {ranks}"
        )
    pr = f["paired_round_ratio"]
    print(
        f"per-round flotilla/DDP ratio (drift check): median {pr['median']:.3f}, "
        f"p10 {pr['p10']:.3f}, p90 {pr['p90']:.3f} over {pr['n']} rounds"
    )
    print(
        f"check: flotilla replicas identical across ranks: {c['digests_equal']['flotilla']} "
        f"({c['digests']['flotilla'][0]}); ddp: {c['digests_equal']['ddp']}; "
        f"max |w_flotilla - w_ddp| = {c['max_abs_param_diff_flotilla_vs_ddp']:.2e}"
        f"{'' if c['ok'] else '  CHECK FAILED'}"
    )
    print(f"wall: {f['wall_s']:.1f} s (worker setup {max(f['worker_setup_s']):.1f} s)")
    print(f"ratio={f['ratio']:.3f}")


def _preset_help(key: str, what: str) -> str:
    return f"{what} (default {FULL[key]:g}; with --quick {QUICK[key]:g})"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short schedule, under 60 s in all")
    p.add_argument("--world", type=int, default=2, choices=(2, 3), help="worker processes (2)")
    p.add_argument("--rounds", type=int, help=_preset_help("rounds", "alternation rounds"))
    p.add_argument("--steps", type=int, help=_preset_help("steps", "timed steps per phase"))
    p.add_argument("--warmup", type=int, help=_preset_help("warmup", "untimed steps each first"))
    p.add_argument(
        "--budget-s",
        type=float,
        help=_preset_help(
            "budget_s", "end after the first even round past this many seconds of timing; 0: never"
        ),
    )
    p.add_argument("--phase-warmup", type=int, default=0, help="untimed steps per phase (0)")
    p.add_argument("--batch", type=int, default=64, help="samples per worker per step (64)")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="bucket MiB, both (4)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (0.01)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per worker (1)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="store/collective timeout (60)")
    p.add_argument("--deadline-s", type=float, default=900.0, help="whole-run limit (900)")
    p.add_argument("--agree-tol", type=float, default=1e-3, help="max |w_flotilla - w_ddp|")
    p.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    for hidden in ("--rank", "--port"):
        p.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for key, value in (QUICK if a.quick else FULL).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if (
        min(a.rounds, a.steps, a.batch, a.threads, a.warmup) < 1
        or a.phase_warmup < 0
        or a.bucket_mb <= 0
        or a.budget_s < 0
    ):
        p.error(
            "rounds, steps, batch, threads and warmup must be >= 1 (DDP rebuilds its buckets "
            "on its first step), phase-warmup and budget-s >= 0, bucket-mb > 0"
        )
    return a


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    if a.worker:
        worker_main(a)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the teardown on SIGTERM too
    t0 = time.perf_counter()
    results = _run_workers(a)
    figures = _report(a, results, time.perf_counter() - t0)
    if a.json:
        _common.write_json(a.json, figures)
    _print(figures)
    return 0 if figures["check"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
