"""When does a point-to-point message arrive if its sender computes right after posting it?

What a pipeline stage does (``pipeline/stage_comm.py``): post an asynchronous send of an
activation or a gradient over its ``comm.collective.Group`` (gloo), then compute the next
microbatch.  Two processes (spawned, 1 intra-op thread each); every round, after a barrier, rank 0
sends a timestamp (blocking), then posts a send of ``--bytes`` bytes and, by mode:

- ``idle``: sleeps 2 ms;
- ``busy``: runs small torch operations (a 4x64x64 matmul and tanh, again and again) for 2 ms,
  then sleeps 2 ms (the emulator's sleep of a device at speed 0.5);

rank 1 waits on its receive and records when the message arrived, against rank 0's timestamp
(one machine: the same monotonic clock).  Modes alternate over ``--rounds`` process pairs (each
pair is a fresh placement of the two processes on the cores); printed: the median delivery per
pair and mode, the medians over pairs, CPU use, and ``ratio=<busy / idle>``.

Measured on the 2-core VM (``--rounds 4``, docs/benchmarks.md, 2026-11-30): idle 0.21-0.23 ms per
pair; busy 0.21 ms in one pair and 2.21-2.25 ms in the three others.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_busy, cpu_jiffies, machine_info

MODES = ("idle", "busy")


def _rank(rank: int, host: str, port: int, mode: str, nbytes: int, repeats: int, out: mp.Queue) -> None:
    import torch

    from flotilla.comm.collective import Group
    from flotilla.comm.store import StoreAddress, connect_store

    torch.set_num_threads(1)
    store = connect_store(StoreAddress(host, port), timeout_s=60.0)
    group = Group(store, namespace=f"p2p-busy-{mode}", rank=rank, world_size=2, timeout_s=60.0)
    payload = torch.zeros(max(1, nbytes // 4))
    stamp = torch.zeros(1, dtype=torch.float64)
    w, x0 = torch.randn(64, 64), torch.randn(4, 64, 64)
    delays = []
    try:
        for _ in range(repeats):
            group.barrier()
            if rank == 0:
                stamp[0] = time.perf_counter()
                group.send(stamp, 1, tag=1).wait()
                handle = group.send(payload, 1, tag=0)
                if mode == "busy":
                    end, x = time.perf_counter() + 0.002, x0
                    while time.perf_counter() < end:
                        x = torch.tanh(x @ w)
                time.sleep(0.002)
                handle.wait()
            else:
                group.recv(stamp, 0, tag=1).wait()
                group.recv(payload, 0, tag=0).wait()
                delays.append(time.perf_counter() - float(stamp[0]))
        if rank == 1:
            out.put(statistics.median(delays[3:]))
    finally:
        group.close()


def one_pair(mode: str, nbytes: int, repeats: int) -> float:
    from flotilla.comm.store import StoreHost

    ctx = mp.get_context("spawn")
    host = StoreHost("127.0.0.1")
    out: mp.Queue = ctx.Queue()
    where = (host.address.host, host.address.port)
    procs = [ctx.Process(target=_rank, args=(r, *where, mode, nbytes, repeats, out)) for r in (0, 1)]
    try:
        for p in procs:
            p.start()
        return float(out.get(timeout=120))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        host.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="process pairs per mode (alternating)")
    ap.add_argument("--bytes", type=int, default=64 << 10, help="the message (default 64 KiB)")
    ap.add_argument("--repeats", type=int, default=40, help="messages per pair (the first 3 not counted)")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 20 messages")
    a = ap.parse_args()
    rounds, repeats = (3, 20) if a.quick else (a.rounds, a.repeats)
    if rounds < 1 or repeats < 5 or a.bytes < 4:
        ap.error("need --rounds >= 1, --repeats >= 5, --bytes >= 4")
    got: dict[str, list[float]] = {m: [] for m in MODES}
    since = cpu_jiffies()
    for r in range(rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            got[mode].append(one_pair(mode, a.bytes, repeats))
            print(f"round {r} {mode:5s} delivery median {got[mode][-1] * 1e3:7.3f} ms", flush=True)
    print(f"machine: {machine_info()}; cpu {cpu_busy(since):.0%}")
    for mode in MODES:
        shown = ", ".join(f"{d * 1e3:.2f}" for d in got[mode])
        print(f"{mode:5s} medians per pair (ms): {shown}; median {statistics.median(got[mode]) * 1e3:.3f}")
    print(f"ratio={statistics.median(got['busy']) / statistics.median(got['idle']):.3f}")


if __name__ == "__main__":
    main()
