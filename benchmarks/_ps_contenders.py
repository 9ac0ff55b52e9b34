"""The contenders of ``benchmarks/ps_throughput.py``: a flotilla PS client (``Flotilla``), the raw
pyzmq echo of the same chunk frames (``Raw``), replicated shards, and the timer.  Each contender has
``iteration()`` (one push+pull of its size, or the echo of the same bytes) and ``close()``."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import _common

NUM_TENSORS = 8


def tensors_of(size_bytes: int) -> dict[str, Any]:
    import torch

    n = size_bytes // 4 // NUM_TENSORS
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(n, generator=gen) for i in range(NUM_TENSORS)}


class Flotilla:
    def __init__(
        self,
        addresses: list[str],
        secret: bytes,
        size_bytes: int,
        chunk_bytes: int,
        two_phase: bool | None = None,
    ) -> None:
        from flotilla.ps.client import ClientOptions, PSClient, keys_of

        self.params = tensors_of(size_bytes)
        self.deltas = {k: v.mul(1e-6) for k, v in self.params.items()}
        self.client = PSClient(
            addresses,
            secret,
            worker_id=0,
            keys=keys_of(self.params),
            chunk_bytes=chunk_bytes,
            options=ClientOptions(pull_timeout_s=60, attempt_timeout_s=30),
            two_phase=two_phase,  # None: two-phase with more than one shard (the default)
        )
        self.client.hello(0)
        self.client.initialize(self.params)
        self.clock = 0
        self.client.pull(0, self.params)

    def iteration(self) -> None:
        self.client.push_pull(self.deltas, self.clock, self.params)
        self.clock += 1

    def close(self) -> None:
        self.client.close()


class Raw:
    def __init__(self, addresses: list[str], plan: Any, tensors: dict[str, Any]) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.socks = []
        for a in addresses:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(a)
            self.socks.append(s)
        flats = {k: v.reshape(-1) for k, v in tensors.items()}
        self.frames: list[list[memoryview]] = [[] for _ in addresses]
        for chunk, shard in zip(plan.chunks, plan.assignment):
            view = flats[chunk.key][chunk.offset_elems : chunk.offset_elems + chunk.num_elems]
            self.frames[shard].append(memoryview(view.numpy()).cast("B"))

    def _one(self, i: int) -> None:
        self.socks[i].send_multipart(self.frames[i], copy=False)
        self.socks[i].recv_multipart(copy=False)

    def iteration(self) -> None:
        threads = [threading.Thread(target=self._one, args=(i,)) for i in range(1, len(self.socks))]
        for t in threads:
            t.start()
        self._one(0)
        for t in threads:
            t.join()

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.ctx.term()


def replicated_shards(
    kids: _common.Children, tmp: Path, secret: bytes, servers: int, chunk: int
) -> list[str]:
    """Replicated shards (a backup and a primary each) for one worker, ASP, delta updates."""
    from flotilla.comm.auth import write_secret_file
    from ps_replication import start_shards

    (tmp / "job.yaml").write_text(
        "cluster: {num_workers: 1}\n"
        "job: {model: {name: tiny_mlp}, dataset: {name: synthetic, num_samples: 100},"
        " optimizer: {kind: sgd, lr: 0.001}, batch_size: 8, steps: 10}\n"
        f"strategy: {{kind: ps, consistency: asp, num_servers: {servers}, update: delta,"
        f" chunk_bytes: {chunk}, replication: 2}}\n"
    )
    write_secret_file(tmp / "secret", secret)
    return start_shards(kids, tmp, servers, replicated=True)


def time_iterations(contender: Any, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        contender.iteration()
    return (time.perf_counter() - start) / iters
