"""``flotilla calibrate``: measure this machine's collective plane and host overhead, and write the
profile ``flotilla simulate --calibration`` reads (``docs/simulator.md``, "Calibration").

1. a rendezvous store on 127.0.0.1 and ``world_size`` processes (this one is rank 0, the others
   are spawned) measure a gloo all-reduce and a point-to-point round trip at each size
   (``comm/calibration.py``: medians after warm-ups);
2. the links that best fit them (``cluster/comm_cost.fit_allreduce_link`` and
   ``fit_transfer_link``: least squares on the formulas the simulator predicts with);
3. the host's fixed cost of one training step: forward, backward and an SGD step of a
   one-parameter model (the median of ``repeats``) -- what a step costs beyond its arithmetic;
4. the message plane's own cost (``msgplane_cost``: signing, framing, copies -- a call's one-way
   time less the point-to-point transfer of the same bytes, fitted as a link by
   ``cluster/comm_cost.fit_software_cost``), which the simulator adds to every message-plane
   transfer (parameter-server pushes and pulls, AD-PSGD's exchanges, controller messages);
5. written atomically as JSON: the samples, the fitted links, the overhead, the machine.

The profile describes only this machine (loopback between processes): links between real
machines are the user's to give (a sizing file, the cluster config).
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flotilla.cluster.comm_cost import fit_allreduce_link, fit_software_cost, fit_transfer_link
from flotilla.comm.auth import generate_secret
from flotilla.core.atomic_io import atomic_write_json

__all__ = ["DEFAULT_SIZES", "PROFILE_VERSION", "calibrate"]

PROFILE_VERSION = 2  # (2: the message plane's own cost, ``msgplane_cost``)
DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]
MAX_SIZE = 128 << 20  # (a message-plane call carries it, under the default 256-MiB message limit)


def _peer(
    host: str, port: int, rank: int, world_size: int, sizes: list[int], repeats: int, secret: bytes
) -> None:
    from flotilla.comm.calibration import measure
    from flotilla.comm.store import StoreAddress

    measure(StoreAddress(host, port), rank, world_size, sizes, repeats=repeats, secret=secret)


def _step_overhead_s(repeats: int) -> float:
    import torch

    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=0.1)
    x = torch.ones(1)
    times = []
    for i in range(repeats + 5):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = (w * x).sum()
        loss.backward()
        opt.step()
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate(
    out: Path, *, world_size: int = 2, sizes: list[int] | None = None, repeats: int = 20,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:  # fmt: skip
    """Measure, fit and write the profile (see the module doc); returns it."""
    from flotilla.comm.calibration import measure
    from flotilla.comm.store import StoreHost

    if not 2 <= world_size <= 16:
        raise ValueError(f"--world-size: must be in [2, 16], got {world_size}")
    if repeats < 3:
        raise ValueError(f"--repeats: must be >= 3, got {repeats}")
    sizes = sorted({max(1, s // 4) * 4 for s in (sizes or DEFAULT_SIZES)})  # (float32s: what is sent)
    if len(sizes) < 2 or sizes[0] < 4:
        raise ValueError(f"--sizes: at least two sizes of >= 4 bytes (whole float32s), got {sizes}")
    if sizes[-1] > MAX_SIZE:
        raise ValueError(f"--sizes: at most {MAX_SIZE} bytes (a message's limit), got {sizes[-1]}")
    host = StoreHost("127.0.0.1")
    ctx = multiprocessing.get_context("spawn")
    where = (host.address.host, host.address.port)
    secret = generate_secret()  # (the message plane's: handed to the peers as an argument)
    peers = [
        ctx.Process(target=_peer, args=(*where, r, world_size, sizes, repeats, secret), daemon=True)
        for r in range(1, world_size)
    ]
    shown = ", ".join(_human(s) for s in sizes)
    say(f"calibrate: {world_size} processes on this machine, sizes {shown}, {repeats} repeats each")
    t0 = time.perf_counter()
    for p in peers:
        p.start()
    try:
        samples = measure(host.address, 0, world_size, sizes, repeats=repeats, secret=secret)
    finally:
        for p in peers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        host.close()
    assert samples is not None  # (rank 0)
    for (b, ar), (_, p2p), (_, mp) in zip(samples["allreduce"], samples["p2p"], samples["msgplane"]):
        say(
            f"  {_human(b):>8s}: all-reduce {ar * 1e3:8.3f} ms, one-way {p2p * 1e3:8.3f} ms, "
            f"message plane one-way {mp * 1e3:8.3f} ms"
        )
    try:
        ar_link = fit_allreduce_link(world_size, [(float(b), t) for b, t in samples["allreduce"]])
        p2p_link = fit_transfer_link([(float(b), t) for b, t in samples["p2p"]])
        mp_cost = fit_software_cost(
            [(float(b), t) for b, t in samples["msgplane"]], [(float(b), t) for b, t in samples["p2p"]]
        )
    except ValueError as exc:
        raise ValueError(
            f"{exc}: too noisy to fit a link -- rerun on a quieter machine, with larger --sizes or "
            "more --repeats"
        ) from None
    overhead = _step_overhead_s(max(repeats, 50))
    profile = {
        "version": PROFILE_VERSION,
        "machine": {"node": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "world_size": world_size,
        "samples": {k: [[b, t] for b, t in v] for k, v in samples.items()},
        "allreduce_link": asdict(ar_link),
        "p2p_link": asdict(p2p_link),
        "msgplane_cost": asdict(mp_cost),
        "step_overhead_s": overhead,
    }
    atomic_write_json(out, profile)
    say(
        f"fitted: all-reduce link {ar_link.bandwidth_gbps:.2f} Gbit/s, {ar_link.latency_s * 1e6:.1f} us; "
        f"point-to-point {p2p_link.bandwidth_gbps:.2f} Gbit/s, {p2p_link.latency_s * 1e6:.1f} us; "
        f"message plane's own cost {mp_cost.bandwidth_gbps:.2f} Gbit/s, {mp_cost.latency_s * 1e6:.1f} us; "
        f"step overhead {overhead * 1e6:.1f} us ({time.perf_counter() - t0:.1f} s) -> {out}"
    )
    return profile


def _human(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"
