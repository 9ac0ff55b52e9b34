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
of every contender, one after the other, alternating the order; the per-size figure is the median
over rounds.  Last line: ``ratio=<flotilla GB/s / raw GB/s>``, the **median over rounds of the
per-round ratio** (round i's raw seconds summed over the sizes over its flotilla seconds summed
over the sizes, so big sizes weigh by their bytes): contender and baseline of one round ran
seconds apart, so a drift of the machine (raw pyzmq scattered 1.3-2.6 GB/s between runs here)
cancels in each ratio instead of in the aggregate (issue 37 item 7); ``ratio_spread=`` gives the
per-round ratios' p10-p90.  ``two_phase_over_single`` and ``replicated_over_plain`` are per-round
medians the same way.  ``--pin`` (default) runs this worker on the first CPU and the shard and
echo processes on the last, so that runs place their processes alike (unpinned, the raw echo's
speed moved between runs by up to 1.4x, a shift no pairing cancels; docs/benchmarks.md).  The
machine's single-core authenticator speed (``auth.sign``: HMAC-SHA256 over BLAKE3 digests of
large frames) is printed too: authentication bounds the ratio.

Run: ``python benchmarks/ps_throughput.py --quick`` (about 95 s on 2 cores) or without ``--quick``;
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
from _ps_contenders import Flotilla, Raw, replicated_shards, time_iterations

MB = 2**20
QUICK = {"sizes_mb": [1, 4, 16, 64], "rounds": 24, "iters": 1}  # many short rounds: see the doc
FULL = {"sizes_mb": [1, 2, 4, 8, 16, 32, 64], "rounds": 15, "iters": 5}


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


def _pin(cpu: int | None) -> None:
    """Run this process (its threads started from now on) on ``cpu`` (``--pin``)."""
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


def _report_and_wait(address: str, close: Any) -> None:
    _common.exit_with_parent()
    print(address, flush=True)
    try:
        sys.stdin.read()  # until the parent closes our stdin (or dies)
    finally:
        close()


# ============================================================================ parent


class _Procs(_common.Children):
    pin = True  # (passed on to the children: --pin / --no-pin)

    def spawn(self, argv: list[str]) -> str:
        flag = "--pin" if self.pin else "--no-pin"
        proc = subprocess.Popen(
            [_common.python(), __file__, *argv, flag],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        if not ready:
            raise RuntimeError(f"child {argv} did not report its address")
        return proc.stdout.readline().strip()


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

    flot = Flotilla(shards(), secret, size, args.chunk_bytes)
    contenders: dict[str, Any] = {"flotilla": flot}
    if args.servers > 1:  # the single-phase path, on its own shards, as the 2PC cost's baseline
        contenders["single"] = Flotilla(shards(), secret, size, args.chunk_bytes, two_phase=False)
    raw = Raw(echo_addresses, flot.client.plan, flot.params)
    contenders["raw"] = raw
    replicas = _common.Children()
    tmp = tempfile.TemporaryDirectory(prefix="ps-bench-replicated-")
    if args.replicated:
        addresses = replicated_shards(replicas, Path(tmp.name), secret, args.servers, args.chunk_bytes)
        contenders["replicated"] = Flotilla(addresses, secret, size, args.chunk_bytes)
    try:
        for name in contenders:  # warm-up, one discarded round: connections, allocations, page
            time_iterations(
                contenders[name], max(2, cfg["iters"])
            )  # faults (the first raw round ran ~1.6x slower)
        samples: dict[str, list[float]] = {name: [] for name in contenders}
        for order in _common.alternating_orders(list(contenders), cfg["rounds"]):
            for name in order:
                samples[name].append(time_iterations(contenders[name], cfg["iters"]))
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
        "rounds_s": samples,  # per round, in round order (the per-round ratios)
    }


def _per_round(results: list[dict[str, Any]], num: str, den: str) -> list[float]:
    """Round i's ``num`` GB/s over ``den`` GB/s, over every size: den's seconds / num's."""
    rounds = len(results[0]["rounds_s"][num])
    return [
        sum(r["rounds_s"][den][i] for r in results) / sum(r["rounds_s"][num][i] for r in results)
        for i in range(rounds)
    ]


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
    ap.add_argument("--quick", action="store_true", help="small run, about 95 s on 2 cores")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--servers", type=int, default=2, help="PS shards (and echo servers)")
    ap.add_argument("--chunk-bytes", type=int, default=4 * MB)
    ap.add_argument("--sizes-mb", type=int, nargs="*", default=None)
    ap.add_argument(
        "--replicated", action=argparse.BooleanOptionalAction, default=True, help="also replicated shards"
    )
    ap.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the worker on the first CPU, the shards and echo servers on the last (steadier ratios)",
    )
    ap.add_argument("--role", choices=["bench", "server", "echo"], default="bench")
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--num-shards", type=int, default=1)
    ap.add_argument("--secret-file", type=Path, default=None)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = args.pin and len(cpus) >= 2
    if args.role == "server":
        _pin(cpus[-1] if pin else None)
        return _serve_ps(args)
    if args.role == "echo":
        _pin(cpus[-1] if pin else None)
        return _serve_echo(args)
    _pin(cpus[0] if pin else None)

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
        procs.pin = args.pin
        echo = [procs.spawn(["--role", "echo"]) for _ in range(args.servers)]
        for size_mb in cfg["sizes_mb"]:
            results.append(_measure_size(procs, args, secret_file, secret, echo, size_mb, cfg))
        for p in procs.procs:
            if p.stdin and not p.stdin.closed:
                p.stdin.close()
    auth_gbps = _auth_gbps()
    total = sum(2 * r["size_bytes"] for r in results)
    agg = {k: total / sum(r["median_s"][k] for r in results) / 1e9 for k in results[0]["median_s"]}
    ratios = _per_round(results, "flotilla", "raw")
    summary = {
        "benchmark": "ps_throughput",
        "config": {**cfg, "servers": args.servers, "chunk_bytes": args.chunk_bytes},
        "machine": _common.machine_info(),
        "sizes": results,
        "aggregate_gbps": agg,
        "ratio": _common.median(ratios),
        "ratio_per_round": ratios,
        "ratio_of_aggregates": agg["flotilla"] / agg["raw"],  # (the headline before issue 37)
        "replicated_over_plain": (
            _common.median(_per_round(results, "replicated", "flotilla")) if "replicated" in agg else None
        ),
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
        print(f"two_phase_over_single={_common.median(_per_round(results, 'flotilla', 'single')):.3f}")
    if "replicated" in agg:
        print(f"replicated_over_plain={summary['replicated_over_plain']:.3f}")
    spread = _common.summarize(ratios)
    print(
        f"ratio_spread=p10 {spread['p10']:.3f} .. p90 {spread['p90']:.3f} over {len(ratios)} rounds "
        f"(ratio of the aggregates {summary['ratio_of_aggregates']:.3f})"
    )
    print(f"ratio={summary['ratio']:.3f}")


if __name__ == "__main__":
    main()
