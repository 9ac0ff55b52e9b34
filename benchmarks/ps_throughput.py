"""Benchmark: parameter-server push+pull bandwidth against a raw pyzmq echo of the same bytes.

For each parameter size M (1 MB … 64 MB, as 8 float32 tensors, chunked at ``--chunk-bytes``):

- ``flotilla``: one worker (:class:`flotilla.ps.client.PSClient`) pushes M bytes of deltas and
  pulls M bytes of parameters from ``--servers`` shard processes (``PSServer`` on zmq tcp,
  127.0.0.1, ASP so pulls never wait) with ``push_pull``: one ``ps.pushpull`` request per shard per
  iteration, shards in parallel, every message HMAC-signed and verified, every value checked and
  applied by the server, chunks reassembled into the model's tensors on pull.
  With more than one shard a push is two-phase (``ps/two_phase.py``: ``ps.stage`` on every
  shard, then the commit carried by the pull, ``ps.cpull``: two round trips per iteration);
  ``single`` (with more than one shard) is the same client on its own shards with one
  ``ps.pushpull`` per shard (the path before two-phase pushes, where a worker dying mid-push
  could leave a clock half-applied): ``two_phase_over_single=`` is the 2PC cost.
- ``replicated`` (``--replicated``, on by default): the same client against shards with chain
  replication (``strategy.replication: 2``, started as ``flotilla run`` starts them: a backup
  and a primary per shard, ``ps/replication.py``; every reply waits for the backup):
  ``replicated_over_plain=`` (and ``replicated_over_plain`` in the JSON) is its cost.
  ``benchmarks/ps_replication.py`` measures the same cost in training and with many workers.
- ``raw``: the same chunk frames (zero-copy views of the same tensors), split over the same number
  of pyzmq ROUTER echo processes the same way, each sent as one multipart message and echoed back;
  no authentication, no decoding, no copy into tensors.

Both move 2·M bytes per iteration; GB/s = 2·M / seconds.  Each round times ``--iters`` iterations
of one contender then of the other, alternating which goes first; the per-size figure is the
median over rounds.  Last line: ``ratio=<flotilla GB/s / raw GB/s>`` where each GB/s is total
bytes over total median time across all sizes (so big sizes weigh by their bytes).  The
machine's single-core authenticator speed (``auth.sign``: HMAC-SHA256 over BLAKE3 digests of
large frames) is printed too: authentication bounds the ratio.

Run: ``python benchmarks/ps_throughput.py --quick`` (under 60 s) or without ``--quick``;
``--json PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

MB = 2**20
QUICK = {"sizes_mb": [1, 4, 16, 64], "rounds": 5, "iters": 3}
FULL = {"sizes_mb": [1, 2, 4, 8, 16, 32, 64], "rounds": 15, "iters": 5}
NUM_TENSORS = 8


# ============================================================================ child processes


def _serve_ps(args: argparse.Namespace) -> None:
    import torch

    from flotilla.comm.auth import read_secret_file
    from flotilla.comm.msgplane import serve
    from flotilla.ps.config import DeltaUpdate, ShardConfig
    from flotilla.ps.consistency import ASP
    from flotilla.ps.server import PSServer

    torch.set_num_threads(1)
    cfg = ShardConfig(
        shard_index=args.shard,
        num_shards=args.num_shards,
        num_workers=1,
        consistency=ASP(),
        update=DeltaUpdate(),
        chunk_bytes=args.chunk_bytes,
    )
    server = PSServer(
        cfg, serve(read_secret_file(args.secret_file), "tcp://127.0.0.1:0", name=f"bench-shard{args.shard}")
    ).start()
    _report_and_wait(server.address, server.close)


def _serve_echo(args: argparse.Namespace) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            if sock.poll(50):
                sock.send_multipart(sock.recv_multipart(copy=False), copy=False)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()

    def close() -> None:
        stop.set()
        thread.join()
        sock.close()
        ctx.term()

    _report_and_wait(f"tcp://127.0.0.1:{port}", close)


def _report_and_wait(address: str, close: Any) -> None:
    _common.exit_with_parent()
    print(address, flush=True)
    try:
        sys.stdin.read()  # until the parent closes our stdin (or dies)
    finally:
        close()


# ============================================================================ parent


class _Procs(_common.Children):
    def spawn(self, argv: list[str]) -> str:
        proc = subprocess.Popen(
            [_common.python(), __file__, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.procs.append(proc)
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        if not ready:
            raise RuntimeError(f"child {argv} did not report its address")
        return proc.stdout.readline().strip()


def _tensors(size_bytes: int) -> dict[str, Any]:
    import torch

    n = size_bytes // 4 // NUM_TENSORS
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(n, generator=gen) for i in range(NUM_TENSORS)}


class _Flotilla:
    def __init__(
        self,
        addresses: list[str],
        secret: bytes,
        size_bytes: int,
        chunk_bytes: int,
        two_phase: bool | None = None,
    ) -> None:
        from flotilla.ps.client import ClientOptions, PSClient, keys_of

        self.params = _tensors(size_bytes)
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


class _Raw:
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


def _replicated_shards(
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


def _time(contender: Any, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        contender.iteration()
    return (time.perf_counter() - start) / iters


def _measure_size(
    procs: _Procs,
    args: argparse.Namespace,
    secret_file: Path,
    secret: bytes,
    echo_addresses: list[str],
    size_mb: int,
    cfg: dict[str, Any],
) -> dict[str, Any]:
    size = size_mb * MB

    def shards() -> list[str]:
        return [
            procs.spawn(
                [
                    "--role",
                    "server",
                    "--shard",
                    str(i),
                    "--num-shards",
                    str(args.servers),
                    "--secret-file",
                    str(secret_file),
                    "--chunk-bytes",
                    str(args.chunk_bytes),
                ]
            )
            for i in range(args.servers)
        ]

    flot = _Flotilla(shards(), secret, size, args.chunk_bytes)
    contenders: dict[str, Any] = {"flotilla": flot}
    if args.servers > 1:  # the single-phase path, on its own shards, as the 2PC cost's baseline
        contenders["single"] = _Flotilla(shards(), secret, size, args.chunk_bytes, two_phase=False)
    raw = _Raw(echo_addresses, flot.client.plan, flot.params)
    contenders["raw"] = raw
    replicas = _common.Children()
    tmp = tempfile.TemporaryDirectory(prefix="ps-bench-replicated-")
    if args.replicated:
        addresses = _replicated_shards(replicas, Path(tmp.name), secret, args.servers, args.chunk_bytes)
        contenders["replicated"] = _Flotilla(addresses, secret, size, args.chunk_bytes)
    try:
        for c in contenders.values():
            _time(c, 2)  # warm-up: connections, allocations
        samples: dict[str, list[float]] = {name: [] for name in contenders}
        for order in _common.alternating_orders(list(contenders), cfg["rounds"]):
            for name in order:
                samples[name].append(_time(contenders[name], cfg["iters"]))
    finally:
        for c in contenders.values():
            c.close()
        own = len(contenders) - 1 - ("replicated" in contenders)  # contenders on this script's shards
        for p in procs.procs[-args.servers * own :]:
            p.stdin.close()
        replicas.stop_all()
        tmp.cleanup()
    med = {k: _common.median(v) for k, v in samples.items()}
    gbps = {k: 2 * size / t / 1e9 for k, t in med.items()}
    single = f" single={gbps['single']:.3f}GB/s" if "single" in gbps else ""
    single += f" replicated={gbps['replicated']:.3f}GB/s" if "replicated" in gbps else ""
    print(
        f"size={size_mb}MB flotilla={gbps['flotilla']:.3f}GB/s raw={gbps['raw']:.3f}GB/s{single} "
        f"ratio={gbps['flotilla'] / gbps['raw']:.3f} (median s/iter flotilla="
        f"{med['flotilla']:.4f} raw={med['raw']:.4f})",
        flush=True,
    )
    return {
        "size_bytes": size,
        "median_s": med,
        "gbps": gbps,
        "samples_s": {k: _common.summarize(v) for k, v in samples.items()},
    }


def _auth_gbps() -> float:
    """Single-core throughput of the message plane's authenticator (``auth.sign``) on 32 MB."""
    from flotilla.comm import auth

    data, secret = os.urandom(32 * MB), auth.generate_secret()
    best = min(_timed(lambda: auth.sign(secret, auth.DOMAIN_REQUEST, [data])) for _ in range(3))
    return len(data) / best / 1e9


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="small run, under 60 s")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--servers", type=int, default=2, help="PS shards (and echo servers)")
    ap.add_argument("--chunk-bytes", type=int, default=4 * MB)
    ap.add_argument("--sizes-mb", type=int, nargs="*", default=None)
    ap.add_argument(
        "--replicated", action=argparse.BooleanOptionalAction, default=True, help="also replicated shards"
    )
    ap.add_argument("--role", choices=["bench", "server", "echo"], default="bench")
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--num-shards", type=int, default=1)
    ap.add_argument("--secret-file", type=Path, default=None)
    args = ap.parse_args()
    if args.role == "server":
        return _serve_ps(args)
    if args.role == "echo":
        return _serve_echo(args)

    import torch

    from flotilla.comm.auth import generate_secret, write_secret_file

    torch.set_num_threads(1)
    cfg = dict(QUICK if args.quick else FULL)
    if args.sizes_mb:
        cfg["sizes_mb"] = args.sizes_mb
    t0 = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="ps-bench-") as tmp, _Procs() as procs:
        secret_file = Path(tmp) / "secret"
        secret = generate_secret()
        write_secret_file(secret_file, secret)
        echo = [procs.spawn(["--role", "echo"]) for _ in range(args.servers)]
        for size_mb in cfg["sizes_mb"]:
            results.append(_measure_size(procs, args, secret_file, secret, echo, size_mb, cfg))
        for p in procs.procs:
            if p.stdin and not p.stdin.closed:
                p.stdin.close()
    auth_gbps = _auth_gbps()
    total = sum(2 * r["size_bytes"] for r in results)
    agg = {k: total / sum(r["median_s"][k] for r in results) / 1e9 for k in results[0]["median_s"]}
    summary = {
        "benchmark": "ps_throughput",
        "config": {**cfg, "servers": args.servers, "chunk_bytes": args.chunk_bytes},
        "machine": _common.machine_info(),
        "sizes": results,
        "aggregate_gbps": agg,
        "ratio": agg["flotilla"] / agg["raw"],
        "replicated_over_plain": agg["replicated"] / agg["flotilla"] if "replicated" in agg else None,
        "auth_sign_gbps_one_core": auth_gbps,
        "wall_s": time.monotonic() - t0,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if args.json is not None:
        _common.write_json(args.json, summary)
    print(
        f"aggregate flotilla={agg['flotilla']:.3f}GB/s raw={agg['raw']:.3f}GB/s "
        f"servers={args.servers} wall={summary['wall_s']:.1f}s; authenticator (HMAC-SHA256 "
        f"over BLAKE3 frame digests) on one core {auth_gbps:.2f}GB/s (a push+pull byte is signed twice "
        f"and verified twice)"
    )
    if "single" in agg:
        print(f"two_phase_over_single={agg['flotilla'] / agg['single']:.3f}")
    if "replicated" in agg:
        print(f"replicated_over_plain={summary['replicated_over_plain']:.3f}")
    print(f"ratio={summary['ratio']:.3f}")


if __name__ == "__main__":
    main()
