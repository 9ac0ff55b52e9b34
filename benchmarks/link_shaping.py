"""Emulated links (``cluster.links.emulate``, ``comm/shaping.py``): measured against modelled.

Real gloo groups on 127.0.0.1 (members in threads of this process, each with its own name), for
each link (bandwidth, latency) and message size, alternating in every round between the shaped
group and the same group unshaped (the transport alone, the baseline):

- ``p2p``: one send, from its post to the receiver's completed wait; modelled
  ``cluster/comm_cost.transfer_s``;
- ``allreduce``: three members, from a common start to the last one's completion; modelled
  ``ring_allreduce_s`` over the (one) link.

Printed per case: the medians over the rounds of the shaped and the plain times, the model, and
``shaped / model``; the shaped time should be the model plus at most the transport's own time
(point-to-point: added to it; all-reduce: the larger of the two).  Last line:
``ratio=<median over cases of shaped / model>`` (1.0: the runtime takes what the planner and
the simulator assume).

    python benchmarks/link_shaping.py --quick      # 3 rounds, 2 links, 2 sizes
    python benchmarks/link_shaping.py --json out.json
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, median, write_json
from flotilla.cluster.comm_cost import ring_allreduce_s, transfer_s
from flotilla.cluster.link_costs import ModelCosts
from flotilla.cluster.spec import Link, LinkModel
from flotilla.comm.collective import Group, wait_disposed
from flotilla.comm.shaping import Shaping
from flotilla.comm.store import StoreHost, connect_store

LINKS = [(0.1, 0.005), (1.0, 0.001), (0.02, 0.02)]  # (Gbit/s, s)
SIZES = [64 * 2**10, 2**20, 4 * 2**20]  # bytes


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    a.rounds = a.rounds or (3 if a.quick else 7)
    return a


def _threads(fns: list[Any]) -> list[Any]:
    out: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        out[i] = fns[i]()

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def groups(host: StoreHost, namespace: str, n: int, link: Link | None) -> list[Group]:
    names = [f"d{i}" for i in range(n)]
    model = LinkModel(default_bandwidth_gbps=link.bandwidth_gbps, latency_s=link.latency_s) if link else None

    def make(rank: int) -> Any:
        shaping = Shaping(me=names[rank], costs=ModelCosts(model)) if model is not None else None
        return lambda: Group(
            connect_store(host.address), namespace=namespace, rank=rank, world_size=n, timeout_s=120.0,
            shaping=shaping,
        )  # fmt: skip

    return _threads([make(r) for r in range(n)])


def p2p_s(pair: list[Group], num_bytes: int) -> float:
    x, y = torch.ones(num_bytes // 4), torch.zeros(num_bytes // 4)
    done: list[float] = []
    start = threading.Barrier(2)

    def receive() -> None:
        h = pair[1].recv(y, 0, tag=7)
        start.wait()
        h.wait()
        done.append(time.monotonic())

    t = threading.Thread(target=receive)
    t.start()
    start.wait()
    t0 = time.monotonic()
    pair[0].send(x, 1, tag=7).wait()
    t.join()
    return done[0] - t0


def allreduce_s(members: list[Group], num_bytes: int) -> float:
    tensors = [torch.ones(num_bytes // 4) for _ in members]
    start = threading.Barrier(len(members))
    t0: list[float] = []

    def one(g: Group, x: torch.Tensor) -> float:
        start.wait()
        if not t0:
            t0.append(time.monotonic())
        g.allreduce(x)
        return time.monotonic()

    ends = _threads([lambda g=g, x=x: one(g, x) for g, x in zip(members, tensors, strict=True)])
    return max(ends) - t0[0]


def main() -> None:
    a = parse_args()
    links = LINKS[:2] if a.quick else LINKS
    sizes = SIZES[:2] if a.quick else SIZES
    host = StoreHost("127.0.0.1")
    rows: list[dict[str, Any]] = []
    try:
        for k, (gbps, lat) in enumerate(links):
            link = Link(bandwidth_gbps=gbps, latency_s=lat)
            built = {
                "p2p": (groups(host, f"p{k}s/", 2, link), groups(host, f"p{k}u/", 2, None)),
                "allreduce": (groups(host, f"a{k}s/", 3, link), groups(host, f"a{k}u/", 3, None)),
            }
            for size in sizes:
                for op, (shaped, plain) in built.items():
                    fn = p2p_s if op == "p2p" else allreduce_s
                    model = transfer_s(size, link) if op == "p2p" else ring_allreduce_s(3, size, link)
                    got: dict[str, list[float]] = {"shaped": [], "plain": []}
                    for r in range(a.rounds):  # alternating, the order swapped every round
                        order = ("shaped", "plain") if r % 2 == 0 else ("plain", "shaped")
                        for which in order:
                            got[which].append(fn(shaped if which == "shaped" else plain, size))
                    row = {
                        "op": op, "gbps": gbps, "latency_s": lat, "bytes": size, "model_s": model,
                        "shaped_s": median(got["shaped"]), "plain_s": median(got["plain"]),
                    }  # fmt: skip
                    row["ratio"] = row["shaped_s"] / model
                    rows.append(row)
                    print(
                        f"{op:9s} {gbps:5.2f} Gbit/s {lat * 1000:4.1f} ms {size / 2**20:6.3f} MiB: "
                        f"shaped {row['shaped_s'] * 1000:8.2f} ms, model {model * 1000:8.2f} ms, "
                        f"plain {row['plain_s'] * 1000:6.2f} ms, shaped/model {row['ratio']:.3f}",
                        flush=True,
                    )
            for pair in built.values():
                for g in [*pair[0], *pair[1]]:
                    g.close()
    finally:
        host.close()
        wait_disposed(30.0)
    ratio = median([r["ratio"] for r in rows])
    if a.json:
        write_json(a.json, {"machine": machine_info(), "rounds": a.rounds, "rows": rows, "ratio": ratio})
    print(f"ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
