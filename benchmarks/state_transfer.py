"""How fast a state reaches a newcomer: ``comm/state_transfer.broadcast_state`` (the small
tensors packed in buckets of one dtype, one broadcast each; a big one alone) against the same
header followed by one broadcast per tensor (how it travelled before session 40), from rank 0 to
rank 1 of a gloo group on 127.0.0.1.

Two states: many small tensors (600 of 64-4,096 floats: norms, biases, small layers and their
optimizer moments) and a few large ones (300 tensors, 89 MB: a small transformer's weights and
Adam's two moments).  Each round times both contenders on both states, alternating which goes
first; the figures are medians over rounds, the last line ``ratio=<buckets / per-tensor>`` on the
small state (the case the buckets are for; the large state's ratio is printed above it).  The
machine's CPU use is printed: a loaded machine makes both slower alike, not the ratio.

    .venv/bin/python benchmarks/state_transfer.py --quick      # 3 rounds, ~15 s
    .venv/bin/python benchmarks/state_transfer.py --rounds 9 --json out.json
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import alternating_orders, cpu_busy, cpu_jiffies, machine_info, median, write_json
from flotilla.comm.collective import EpochGroup, Group
from flotilla.comm.state_transfer import broadcast_state
from flotilla.comm.store import StoreHost, connect_store


def per_tensor(group: Group, src: int, meta: dict | None, tensors: Sequence[torch.Tensor] | None) -> None:
    """The baseline: the same msgpack header, then one broadcast per tensor."""
    if group.rank == src:
        assert meta is not None and tensors is not None
        desc = [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for t in tensors]
        payload = msgpack.packb({"meta": meta, "tensors": desc}, use_bin_type=True)
        group.broadcast([torch.tensor([len(payload)], dtype=torch.int64)], src)
        group.broadcast([torch.frombuffer(bytearray(payload), dtype=torch.uint8)], src)
        group.broadcast([t.detach().contiguous() for t in tensors], src)
        return
    length = torch.zeros(1, dtype=torch.int64)
    group.broadcast([length], src)
    buf = torch.empty(int(length), dtype=torch.uint8)
    group.broadcast([buf], src)
    decoded = msgpack.unpackb(buf.numpy().tobytes(), raw=False)
    group.broadcast(
        [torch.empty(d["shape"], dtype=getattr(torch, d["dtype"])) for d in decoded["tensors"]], src
    )


def states() -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    small = [torch.randn(int(n), generator=g) for n in torch.randint(64, 4096, (600,), generator=g)]
    layer = [(256, 256), (256,), (1024, 256), (1024,), (256, 1024), (256,), (256,), (256,)]
    weights = [torch.randn(s, generator=g) for s in (layer * 13)[:100]]
    return {"small": small, "large": weights * 3}


def timed(groups: dict[int, Group], fn: Callable[..., Any], state: list[torch.Tensor]) -> float:
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            fn(groups[rank], 0, {"step": 1} if rank == 0 else None, state if rank == 0 else None)
        except BaseException as exc:  # (re-raised below)
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    rounds = 3 if a.quick else a.rounds
    host = StoreHost()
    groups: dict[int, Group] = {}

    def make(rank: int) -> None:
        groups[rank] = EpochGroup(connect_store(host.address), epoch=1, rank=rank, world_size=2)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    contenders = {"buckets": broadcast_state, "per_tensor": per_tensor}
    times: dict[str, dict[str, list[float]]] = {s: {c: [] for c in contenders} for s in ("small", "large")}
    cpu0 = cpu_jiffies()
    try:
        for name, state in states().items():
            mb = sum(t.numel() * t.element_size() for t in state) / 1e6
            for order in alternating_orders(list(contenders), rounds):
                for c in order:
                    times[name][c].append(timed(groups, contenders[c], state))
            b, p = median(times[name]["buckets"]), median(times[name]["per_tensor"])
            print(f"{name}: {len(state)} tensors, {mb:.1f} MB: buckets {b * 1e3:.1f} ms, "
                  f"per tensor {p * 1e3:.1f} ms, buckets / per tensor {b / p:.3f}", flush=True)  # fmt: skip
    finally:
        for g in groups.values():
            g.close()
        host.close()
    print(f"machine: {machine_info()}; CPU busy {cpu_busy(cpu0):.2f}")
    ratio = median(times["small"]["buckets"]) / median(times["small"]["per_tensor"])
    if a.json:
        write_json(a.json, {"rounds": rounds, "times": times, "machine": machine_info(), "ratio": ratio})
    print(f"ratio={ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
