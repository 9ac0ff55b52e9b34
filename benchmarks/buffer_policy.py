"""The cost of the ``allreduce`` buffer policy (``sync/buffers.py``: BatchNorm's running statistics
averaged at every commit): 3 replicas on real gloo groups (threads of this process, loopback),
a small BatchNorm CNN (3 conv + BatchNorm2d blocks, 32x32 inputs), the same steps with the policy
on and with it off (the replicas' buffers left out), alternating in one run.  Figures: the median
step time per setting, the median time of the buffers' all-reduce alone (same group and size);
last line ``ratio=<on / off>``.

    .venv/bin/python benchmarks/buffer_policy.py --quick     # 3 rounds of 30 steps
    .venv/bin/python benchmarks/buffer_policy.py --rounds 7 --steps 60
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import alternating_orders, machine_info, write_json
from flotilla.comm.collective import EpochGroup
from flotilla.comm.store import StoreHost, connect_store
from flotilla.sync import buffers as buffers_mod
from flotilla.sync.allreduce import BucketedAllReduce
from flotilla.trainer.step import run_step

WORKERS = 3


def cnn() -> nn.Module:
    g = torch.Generator().manual_seed(0)
    layers: list[nn.Module] = []
    ch = 3
    for out in (32, 64, 64):
        layers += [nn.Conv2d(ch, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU(), nn.MaxPool2d(2)]
        ch = out
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(64 * 4 * 4, 10))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def one_run(policy: str, steps: int, epoch: int, host: StoreHost, alone: list[float]) -> float:
    """Median step time (s) of worker 0 over ``steps`` steps (the first 3 left out)."""
    times: list[float] = []
    x = torch.randn(96, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (96,), generator=torch.Generator().manual_seed(2))

    def worker(w: int) -> None:
        group = EpochGroup(connect_store(host.address), epoch=epoch, rank=w, world_size=WORKERS, timeout_s=60)
        model = cnn()
        sync = BucketedAllReduce(
            model, bucket_bytes=1 << 20, optimizer=torch.optim.SGD(model.parameters(), lr=0.01)
        )
        if policy == "off":
            sync.buffers = buffers_mod.ReplicaBuffers(nn.Module())  # no buffers: nothing reduced
        sync.bind(group)
        mine = torch.arange(96).tensor_split(WORKERS)[w]
        for s in range(steps):
            t0 = time.perf_counter()
            run_step(model, sync, x[mine], y[mine], step=s, global_batch=96)
            if w == 0 and s >= 3:
                times.append(time.perf_counter() - t0)
        if policy == "on":  # the buffers' collective alone, same group, same size
            flat = torch.zeros(sync.buffers.num_bytes // 8, dtype=torch.float64)
            for _ in range(20):
                t0 = time.perf_counter()
                group.allreduce(flat)
                if w == 0:
                    alone.append(time.perf_counter() - t0)
        sync.close()
        group.close()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None, help="write every figure here")
    args = ap.parse_args()
    rounds, steps = (3, 30) if args.quick else (args.rounds, args.steps)
    torch.set_num_threads(1)
    host = StoreHost("127.0.0.1")
    figures: dict[str, list[float]] = {"on": [], "off": []}
    epoch = 0
    alone: list[float] = []
    for order in alternating_orders(["on", "off"], rounds):
        for policy in order:
            epoch += 1
            figures[policy].append(one_run(policy, steps, epoch, host, alone))
            print(f"{policy}: median step {figures[policy][-1] * 1e3:.2f} ms", flush=True)
    host.close()
    on, off = statistics.median(figures["on"]), statistics.median(figures["off"])
    bytes_ = buffers_mod.ReplicaBuffers(cnn()).num_bytes
    params = sum(p.numel() * 4 for p in cnn().parameters())
    if args.json:
        data = {
            "machine": machine_info(),
            "figures_s": figures,
            "buffer_bytes": bytes_,
            "param_bytes": params,
        }
        write_json(args.json, {**data, "collective_alone_s": alone})
    print(f"buffers reduced per step: {bytes_} bytes (gradients: {params} bytes)")
    print(f"the buffers' all-reduce alone: median {statistics.median(alone) * 1e3:.3f} ms")
    print(f"on={on * 1e3:.2f} ms off={off * 1e3:.2f} ms ratio={on / off:.3f}")


if __name__ == "__main__":
    main()
