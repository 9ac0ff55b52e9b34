"""Accuracy after a fixed number of clocks under BSP, SSP(3) and SSP's staleness-for-latency options.

Why this exists: ``ps_consistency.py`` measures *time* to accuracy; SSP can only beat BSP there by
waiting less, and every way of waiting less (``strategy.read_ahead``, ``strategy.cached_reads``)
makes reads staler.  This benchmark isolates the accuracy side: the same model, data and
optimizer as ``examples/ps_ssp.yaml`` (cnn1d on mnist1d, global batch 128 over 4 workers, one at
speed 0.33), trained for a fixed number of clocks, so wall-clock noise does not enter the figure.

Everything runs in this process: 2 parameter-server shards (``flotilla.ps.server.PSServer`` on the
in-process ``mem://`` transport, HMAC-authenticated like the real one) and one thread per worker
using ``PSSync`` exactly as ``flotilla run`` does; the straggler's compute is stretched by the
same ``SpeedEmulator`` the real workers use.  Each worker draws its own minibatches (seeded per
worker); rank 0 pulls the final global weights once every worker has pushed every clock and the
test accuracy of those weights is the result.  Variants run alternately, the order reversed every
round.  Last line: ``ratio=<median accuracy of the contender / median accuracy of the baseline>``
(by default SSP with read-ahead against plain SSP).

    python benchmarks/ps_staleness.py --quick
    python benchmarks/ps_staleness.py --rounds 3 --clocks 300 --json out.json
    python benchmarks/ps_staleness.py --set job.optimizer.momentum=0.5 --set job.optimizer.lr=0.25

A variant is ``NAME:OVERRIDE,OVERRIDE...`` over ``strategy`` (e.g. ``ra:consistency=ssp,read_ahead=true``).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from torch import nn

from _common import alternating_orders, median, report_medians
from flotilla.cluster.emulation import SpeedEmulator
from flotilla.comm import auth
from flotilla.comm.msgplane import serve
from flotilla.config.load import load_config
from flotilla.core.threads import use_torch_threads
from flotilla.ps.client import ClientOptions
from flotilla.ps.server import PSServer, shard_config_from
from flotilla.sync.ps_settings import ps_config_from
from flotilla.sync.via_ps import PSSync
from flotilla.trainer import builders
from flotilla.trainer.task_load import TaskData, evaluate_task

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VARIANTS = [
    "bsp:consistency=bsp",
    "ssp:consistency=ssp",
    "ssp_read_ahead:consistency=ssp,read_ahead=true",
    "ssp_cached:consistency=ssp,cached_reads=true",
]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round of 200 clocks (under 60 s)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--clocks", type=int, default=None, help="clocks every worker trains")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:K=V,...",
        help=f"strategy overrides per variant (default: {' '.join(DEFAULT_VARIANTS)})",
    )
    ap.add_argument("--baseline", default="ssp", help="variant in the ratio's denominator")
    ap.add_argument("--contender", default="ssp_read_ahead", help="variant in the ratio's numerator")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every variant (e.g. job.optimizer.momentum=0.5)",
    )
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.clocks = a.clocks or (200 if a.quick else 300)
    a.variants = dict(_variant(v) for v in (a.variant or DEFAULT_VARIANTS))
    for name in (a.baseline, a.contender):
        if name not in a.variants:
            ap.error(f"--baseline/--contender {name!r} is not a variant ({', '.join(a.variants)})")
    if a.rounds < 1 or a.clocks < 1:
        ap.error("--rounds and --clocks must be >= 1")
    return a


def _variant(spec: str) -> tuple[str, list[str]]:
    name, sep, rest = spec.partition(":")
    if not sep or not name:
        raise SystemExit(f"--variant {spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]")
    return name, [f"strategy.{kv}" for kv in rest.split(",") if kv]


def run_once(name: str, overrides: list[str], a: argparse.Namespace, task, secret: bytes) -> dict:
    cfg = load_config(ROOT / "examples/ps_ssp.yaml", [*a.set, *overrides])
    workers = cfg.cluster.resolved_workers()
    n = len(workers)
    x_train, y_train = task.train_data()
    per_worker = cfg.job.batch_size // n
    torch.manual_seed(cfg.job.seed)
    initial = builders.build_task_model(cfg, task)
    models = [builders.build_task_model(cfg, task) for _ in range(n)]
    for m in models:
        m.load_state_dict(initial.state_dict())
    tag = f"{name}-{time.monotonic_ns()}"
    shards = [
        PSServer(
            shard_config_from(ps_config_from(cfg.strategy, cfg.job.optimizer), num_workers=n, shard_index=i),
            serve(secret, f"mem://{tag}-{i}", name=f"shard{i}"),
        ).start()
        for i in range(cfg.strategy.num_servers)
    ]
    errors: list[BaseException] = []
    t0 = time.monotonic()
    try:
        opts = ClientOptions(pull_timeout_s=cfg.strategy.pull_timeout_s, attempt_timeout_s=5.0)
        ps_cfg = ps_config_from(cfg.strategy, cfg.job.optimizer)
        syncs = [
            PSSync(
                m,
                ps_cfg,
                [s.address for s in shards],
                secret,
                w,
                num_workers=n,
                optimizer=builders.build_optimizer(cfg, m),
                options=opts,
            )
            for w, m in enumerate(models)
        ]

        def work(w: int) -> None:
            sync, model, emu = syncs[w], models[w], SpeedEmulator(workers[w].speed)
            try:
                sync.initialize()
                gen = torch.Generator().manual_seed(cfg.job.seed * 1000 + w)
                for clock in range(a.clocks):
                    idx = torch.randint(0, x_train.shape[0], (per_worker,), generator=gen)
                    emu.start()
                    loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx], reduction="sum")
                    (loss / cfg.job.batch_size).backward()
                    emu.mark()
                    sync.push_pull(clock)
                if w == 0:
                    sync.pull_final(a.clocks)
            except BaseException as exc:  # reported below; the other workers' pulls time out
                errors.append(exc)
            finally:
                sync.close()

        threads = [threading.Thread(target=work, args=(w,), name=f"worker{w}") for w in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for s in shards:
            s.close()
    if errors:
        raise SystemExit(f"variant {name} failed: {errors[0]!r}")
    ev = evaluate_task(task, models[0], TaskData(task.eval_data()))
    return {
        "variant": name,
        "test_accuracy": ev["accuracy"],
        "test_loss": ev["loss"],
        "wall_s": time.monotonic() - t0,
    }


def main() -> None:
    a = parse_args()
    use_torch_threads()  # one intra-op thread, like flotilla's workers
    cfg = load_config(ROOT / "examples/ps_ssp.yaml", a.set)
    task = builders.build_task(cfg)
    secret = auth.generate_secret()
    opt = cfg.job.optimizer
    print(
        f"cnn1d/mnist1d, {len(cfg.cluster.resolved_workers())} workers "
        f"(speeds {[w.speed for w in cfg.cluster.resolved_workers()]}), global batch "
        f"{cfg.job.batch_size}, lr {opt.lr}, momentum {opt.momentum}, staleness "
        f"{getattr(ps_config_from(cfg.strategy, opt).consistency, 'staleness', None)}, "
        f"{a.clocks} clocks, {a.rounds} round(s)",
        flush=True,
    )
    results: dict[str, list[dict]] = {v: [] for v in a.variants}
    t_start = time.monotonic()
    for r, order in enumerate(alternating_orders(list(a.variants), a.rounds)):
        for name in order:
            res = run_once(name, a.variants[name], a, task, secret)
            results[name].append(res)
            print(
                f"round {r} {name}: test accuracy {res['test_accuracy']:.4f} "
                f"(loss {res['test_loss']:.3f}, {res['wall_s']:.1f} s)",
                flush=True,
            )
    med = {v: median([x["test_accuracy"] for x in runs]) for v, runs in results.items()}
    report_medians(
        a,
        t_start,
        "test_accuracy",
        med,
        {v: [x["test_accuracy"] for x in runs] for v, runs in results.items()},
        med[a.contender] / med[a.baseline],
        digits=4,
        extra={"results": results},
        ratio_note=f"{a.contender} / {a.baseline}",
    )


if __name__ == "__main__":
    main()
