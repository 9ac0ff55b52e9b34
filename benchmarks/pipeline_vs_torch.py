"""Benchmark: pipeline step time, flotilla's 1F1B stage runtime against torch's ``Schedule1F1B``.

Two worker processes (one per stage, gloo on 127.0.0.1, one intra-op thread each) hold the SAME
stage modules: the zoo's ``char_transformer`` (embedding, 4 blocks, head; ``--width``) cut evenly
into two stages, built twice from one seed (one copy per contender, identical initial weights).
Both contenders train on the same random character batches (``--batch`` windows of 64), SGD with
momentum, cross-entropy averaged over the minibatch:

- ``torch``: ``torch.distributed.pipelining.PipelineStage`` + ``Schedule1F1B`` over the default gloo
  group (``init_process_group`` through a prefixed store), shapes given up front;
- ``flotilla``: what ``flotilla run`` executes per step: the stage engine
  (``flotilla.trainer.stage_engine.StageEngine``) running one unit (one flush of
  ``one_f_one_b(2, m, steps)``, including its non-finite guard: a 2-element all-reduce before the
  update) on ``flotilla.pipeline.runtime.StageRuntime`` over a flotilla ``EpochGroup``.

For each m in ``--microbatches`` (default 4 and 8), rounds alternate the contenders (order swapped
every round), each phase running ``steps`` timed steps (default 1: the contenders alternate step by
step, so both see the same load on a shared machine) after a barrier; a step (rank 0, perf_counter)
is the whole minibatch: schedule + optimizer step.  After the timed run both contenders have taken
the same steps on the same data, so their parameters must agree (checked).

Also measured with flotilla's runtime (untimed for the ratio): the peak bytes of activations held
for pending backwards (autograd saved tensors, weights excluded) of 1F1B and GPipe at m = 8, and the
throughput of asynchronous PipeDream (one unit = one microbatch of batch/m, an update per unit)
against flushed 1F1B over the same number of samples.

Output: the figures, then as the last line ``ratio=<flotilla 1F1B median step / torch median
step>`` (per m, median over median; the last line is their geometric mean over the m values).
``--quick`` runs in under 60 s; ``--json PATH`` writes
everything.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

CONTENDERS = ("torch", "flotilla")
SEQ, VOCAB = 64, 96
QUICK = {"rounds": 30, "steps": 1, "warmup": 3, "async_steps": 6}
FULL = {"rounds": 120, "steps": 1, "warmup": 5, "async_steps": 20}
ENDS = (3, 6)


# ============================================================================ worker process


def _model(width: int) -> Any:
    from flotilla.models.zoo import build_model

    return build_model("char_transformer", input_shape=(SEQ,), num_classes=VOCAB, width=width, seed=0)


def _batches(batch: int, count: int) -> list[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(count):
        x = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def _loss(out: Any, y: Any) -> Any:
    import torch

    return torch.nn.functional.cross_entropy(out, y)


class _FixedData:
    """flotilla ``StageData`` for one minibatch split into m microbatches (array_split)."""

    def __init__(self, m: int) -> None:
        self.m, self.x, self.y = m, None, None

    def set(self, x: Any, y: Any) -> None:
        self.x, self.y = x.tensor_split(self.m), y.tensor_split(self.m)

    def batch_size(self, b: int) -> int:
        return int(self.x[b % self.m].shape[0])

    def input(self, b: int) -> Any:
        return self.x[b % self.m]

    def target(self, b: int) -> Any:
        return self.y[b % self.m]

    def loss_scale(self, b: int) -> float:
        return self.batch_size(b) / sum(int(t.shape[0]) for t in self.x)


class _Flotilla:
    def __init__(self, a: argparse.Namespace, group: Any, m: int, options: Any = None) -> None:
        import torch

        from flotilla.pipeline.runtime import RuntimeOptions, StageRuntime
        from flotilla.pipeline.split import boundary_specs, split_sequential

        model = _model(a.width)
        spec = boundary_specs(model, torch.zeros(1, SEQ, dtype=torch.long), ENDS)[0]
        self.module = split_sequential(model, ENDS)[a.rank]
        self.opt = torch.optim.SGD(self.module.parameters(), lr=a.lr, momentum=0.9)
        self.data, self.m = _FixedData(m), m
        self.rt = StageRuntime(
            self.module,
            self.opt,
            stage_idx=a.rank,
            group=group,
            data=self.data,
            loss_fn=_loss,
            in_spec=spec if a.rank == 1 else None,
            out_spec=spec if a.rank == 0 else None,
            options=options or RuntimeOptions(record_timeline=False),
        )

    def step(self, x: Any, y: Any, schedule: Any) -> Any:
        self.data.set(x, y)
        return self.rt.run(schedule)


class _Torch:
    def __init__(self, a: argparse.Namespace, m: int) -> None:
        import torch
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        from flotilla.pipeline.split import split_sequential

        self.module = split_sequential(_model(a.width), ENDS)[a.rank]
        self.opt = torch.optim.SGD(self.module.parameters(), lr=a.lr, momentum=0.9)
        mb = -(-a.batch // m)
        # the boundary activation's example must require grad, or torch exchanges no gradient for it
        act = torch.zeros(mb, SEQ, a.width, requires_grad=True)
        inp = torch.zeros(mb, SEQ, dtype=torch.long) if a.rank == 0 else act
        out = act if a.rank == 0 else torch.zeros(mb, VOCAB, SEQ)
        stage = PipelineStage(
            self.module, a.rank, 2, torch.device("cpu"), input_args=(inp,), output_args=(out,)
        )
        self.schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=_loss)
        self.rank = a.rank

    def step(self, x: Any, y: Any) -> None:
        self.opt.zero_grad(set_to_none=True)
        if self.rank == 0:
            self.schedule.step(x)
        else:
            self.schedule.step(target=y, losses=[], return_outputs=False)
        self.opt.step()


def _timed_phase(run_one: Any, batches: list, num: int, counter: list[int]) -> list[float]:
    times = []
    for _ in range(num):
        x, y = batches[counter[0] % len(batches)]
        counter[0] += 1
        t0 = time.perf_counter()
        run_one(x, y)
        times.append(time.perf_counter() - t0)
    return times


class _Engine:
    """The stage engine over a schedule of ``num_steps`` flushes, one unit per call."""

    def __init__(self, flo: _Flotilla, group: Any, m: int, num_steps: int, rank: int) -> None:
        from flotilla.cluster.membership import View
        from flotilla.pipeline.schedule import one_f_one_b
        from flotilla.trainer.stage_engine import StageEngine, StageSync

        self.flo, self.rank, self.step = flo, rank, 0
        self.engine = StageEngine(flo.rt, one_f_one_b(2, m, num_steps), group)
        self.sync, self.view = StageSync(), View(epoch=1, members=(0, 1))

    def __call__(self, x: Any, y: Any) -> None:
        from flotilla.sync.base import Proposal
        from flotilla.trainer.parts import UnitWhere

        self.flo.data.set(x, y)
        where = UnitWhere(first_step=self.step, last_step=self.step, view=self.view, rank=self.rank)
        res = self.engine.run_unit(where, self.sync, Proposal())
        assert res.decision.committed, res.decision.reason
        self.step = self.engine.step = self.step + 1


def _compare_m(a: argparse.Namespace, group: Any, m: int, batches: list) -> dict:
    flo, tor = _Flotilla(a, group, m), _Torch(a, m)
    engine = _Engine(flo, group, m, a.warmup + a.rounds * a.steps, a.rank)
    runs = {"flotilla": engine, "torch": tor.step}
    counters = {n: [0] for n in CONTENDERS}
    times: dict[str, list[float]] = {n: [] for n in CONTENDERS}
    for n in CONTENDERS:
        _timed_phase(runs[n], batches, a.warmup, counters[n])
    for order in _common.alternating_orders(CONTENDERS, a.rounds):
        for n in order:
            group.barrier()
            times[n].extend(_timed_phase(runs[n], batches, a.steps, counters[n]))
    engine.engine.finish()
    group.barrier()
    diff = max(
        float((p - q).detach().abs().max()) for p, q in zip(flo.module.parameters(), tor.module.parameters())
    )
    assert counters["flotilla"] == counters["torch"]
    return {"times_s": times, "max_abs_param_diff": diff, "num_steps": counters["flotilla"][0]}


def _memory_and_async(a: argparse.Namespace, group: Any, batches: list) -> dict:
    from flotilla.pipeline.runtime import RuntimeOptions
    from flotilla.pipeline.schedule import gpipe, one_f_one_b, pipedream

    m = 8
    out: dict[str, Any] = {}
    for name, sched in (("gpipe", gpipe(2, m, 1)), ("1f1b", one_f_one_b(2, m, 1))):
        flo = _Flotilla(a, group, m, RuntimeOptions(record_timeline=False, track_memory=True))
        res = [flo.step(*batches[k], sched) for k in range(2)][-1]
        out[f"peak_activation_bytes_{name}"] = res.peak_activation_bytes
        out[f"peak_in_flight_{name}"] = res.peak_in_flight
    # throughput: the same samples through flushed 1F1B (k minibatches of m microbatches) and through
    # PipeDream (k*m units of one microbatch each, an update after every unit)
    k = a.async_steps
    xs = [batches[i % len(batches)] for i in range(k)]
    import torch

    x_all, y_all = torch.cat([x for x, _ in xs]), torch.cat([y for _, y in xs])
    for name, sched, mm in (("1f1b", one_f_one_b(2, m, k), k * m), ("pipedream", pipedream(2, k * m), k * m)):
        flo = _Flotilla(a, group, mm)
        flo.data.set(x_all, y_all)
        if name == "1f1b":  # loss scale: each microbatch is 1/m of its minibatch
            flo.data.loss_scale = lambda b: 1.0 / m
        else:
            flo.data.loss_scale = lambda b: 1.0
        group.barrier()
        t0 = time.perf_counter()
        flo.rt.run(sched)
        group.barrier()
        out[f"samples_per_s_{name}"] = int(x_all.shape[0]) / (time.perf_counter() - t0)
    return out


def worker_main(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from flotilla.comm.collective import EpochGroup
    from flotilla.comm.store import StoreAddress, connect_store

    _common.exit_with_parent()
    torch.set_num_threads(1)
    store = connect_store(StoreAddress("127.0.0.1", a.port), timeout_s=a.timeout_s)
    dist.init_process_group("gloo", store=dist.PrefixStore("torch/", store), rank=a.rank, world_size=2)
    group = EpochGroup(
        dist.PrefixStore("flotilla/", store), epoch=0, rank=a.rank, world_size=2, timeout_s=a.timeout_s
    )
    batches = _batches(a.batch, 4)
    result: dict[str, Any] = {"rank": a.rank, "per_m": {}}
    for m in a.microbatches:
        result["per_m"][str(m)] = _compare_m(a, group, m, batches)
    result.update(_memory_and_async(a, group, batches))
    _common.write_json(Path(a.out_dir) / f"rank{a.rank}.json", result)
    group.barrier()
    group.close()
    dist.destroy_process_group()


# ============================================================================ parent process


def _run_workers(a: argparse.Namespace) -> list[dict]:
    import json

    from flotilla.comm.store import StoreHost

    store = StoreHost("127.0.0.1", 0, timeout_s=a.timeout_s)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    try:
        with tempfile.TemporaryDirectory(prefix="pipeline_vs_torch-") as out_dir, _common.Children() as kids:
            for rank in range(2):
                argv = [
                    _common.python(),
                    str(Path(__file__).resolve()),
                    "--worker",
                    "--rank",
                    str(rank),
                    "--port",
                    str(store.address.port),
                    "--out-dir",
                    out_dir,
                ]
                for key in ("rounds", "steps", "warmup", "async_steps", "batch", "width", "lr", "timeout_s"):
                    argv += [f"--{key.replace('_', '-')}", str(getattr(a, key))]
                argv += ["--microbatches", *map(str, a.microbatches)]
                kids.start(argv, env=env)
            codes = kids.wait_all(timeout_s=a.deadline_s)
            if any(codes):
                raise SystemExit(f"pipeline_vs_torch: worker exit codes {codes}")
            return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(2)]
    finally:
        store.close()


def _report(a: argparse.Namespace, results: list[dict], wall_s: float) -> dict:
    r0 = results[0]
    per_m = {}
    for m, fig in r0["per_m"].items():
        stats = {n: _common.summarize([t * 1e3 for t in fig["times_s"][n]]) for n in CONTENDERS}
        per_m[m] = {
            "step_ms_rank0": stats,
            "ratio": stats["flotilla"]["median"] / stats["torch"]["median"],
            "max_abs_param_diff": max(r["per_m"][m]["max_abs_param_diff"] for r in results),
            "raw_step_s_rank0": fig["times_s"],
            "num_steps": fig["num_steps"],
        }
    peak = {k: max(r[f"peak_activation_bytes_{k}"] for r in results) for k in ("gpipe", "1f1b")}
    return {
        "benchmark": "pipeline_vs_torch",
        "model": "char_transformer",
        "width": a.width,
        "seq_len": SEQ,
        "layer_ends": list(ENDS),
        "batch": a.batch,
        "microbatches": a.microbatches,
        "rounds": a.rounds,
        "steps_per_round": a.steps,
        "warmup_steps": a.warmup,
        "quick": a.quick,
        "per_m": per_m,
        "peak_activation_bytes_m8": peak,
        "peak_activation_ratio_1f1b_over_gpipe": peak["1f1b"] / peak["gpipe"],
        "peak_in_flight_m8": {k: [r[f"peak_in_flight_{k}"] for r in results] for k in ("gpipe", "1f1b")},
        "samples_per_s": {k: r0[f"samples_per_s_{k}"] for k in ("1f1b", "pipedream")},
        "async_over_flushed_throughput": r0["samples_per_s_pipedream"] / r0["samples_per_s_1f1b"],
        "ratio": math.prod(v["ratio"] for v in per_m.values()) ** (1 / len(per_m)),
        "wall_s": wall_s,
        "machine": _common.machine_info(),
    }


def _print(f: dict) -> None:
    mach = f["machine"]
    print(
        f"pipeline_vs_torch: char_transformer width {f['width']}, 2 stages (layers {f['layer_ends']}), batch "
        f"{f['batch']} x {f['seq_len']} chars, SGD momentum 0.9, gloo 127.0.0.1, 1 thread/stage"
    )
    print(
        f"machine: {mach['cpu_model']}, nproc {mach['nproc']}, torch {mach['torch']}, "
        f"loadavg {mach.get('loadavg_1m', float('nan')):.2f}"
    )
    print(f"{'m':>3} {'contender':<9} {'median_ms':>10} {'p10_ms':>8} {'p90_ms':>8} {'steps':>6}")
    for m, fig in f["per_m"].items():
        for n in CONTENDERS:
            s = fig["step_ms_rank0"][n]
            print(f"{m:>3} {n:<9} {s['median']:>10.2f} {s['p10']:>8.2f} {s['p90']:>8.2f} {s['n']:>6}")
        print(
            f"{m:>3} ratio flotilla/torch {fig['ratio']:.3f}; max |w_flotilla - w_torch| after "
            f"{fig['num_steps']} steps = {fig['max_abs_param_diff']:.2e}"
        )
    pk = f["peak_activation_bytes_m8"]
    print(
        f"peak in-flight activations at m=8 (max over stages): gpipe {pk['gpipe'] / 2**20:.2f} MiB, "
        f"1f1b {pk['1f1b'] / 2**20:.2f} MiB, ratio 1f1b/gpipe "
        f"{f['peak_activation_ratio_1f1b_over_gpipe']:.3f}; "
        f"in flight per stage gpipe {f['peak_in_flight_m8']['gpipe']}, 1f1b {f['peak_in_flight_m8']['1f1b']}"
    )
    sp = f["samples_per_s"]
    print(
        f"throughput: pipedream (async) {sp['pipedream']:.1f} samples/s, 1f1b (flushed) {sp['1f1b']:.1f} "
        f"samples/s, async/flushed {f['async_over_flushed_throughput']:.3f}"
    )
    print(f"wall: {f['wall_s']:.1f} s")
    print(f"ratio={f['ratio']:.3f}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"short schedule {QUICK} (< 60 s)")
    p.add_argument("--rounds", type=int)
    p.add_argument("--steps", type=int, help="timed steps per contender per round")
    p.add_argument("--warmup", type=int, help="untimed steps per contender first")
    p.add_argument("--async-steps", type=int, help="minibatches of the async/flushed throughput run")
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--deadline-s", type=float, default=900.0)
    p.add_argument("--json", metavar="PATH", help="write all figures to this JSON file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for key, value in (QUICK if a.quick else FULL).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if min(a.rounds, a.steps, a.warmup, a.async_steps, a.batch, *a.microbatches) < 1:
        p.error("counts and sizes must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    if a.worker:
        worker_main(a)
        return 0
    t0 = time.perf_counter()
    figures = _report(a, _run_workers(a), time.perf_counter() - t0)
    if a.json:
        _common.write_json(a.json, figures)
    _print(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
