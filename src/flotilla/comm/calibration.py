"""The measurements of ``flotilla calibrate`` (``launch/calibrate.py``): what this machine's
collective plane costs, for the simulator's cost model (``docs/simulator.md``, "Calibration").

:func:`measure` runs in each of ``world_size`` processes (one per rank) over a gloo group of the
store at ``address`` -- the same :class:`~flotilla.comm.collective.Group` the strategies use --
and returns, on rank 0, per message size (bytes):

- ``allreduce``: the median time of a sum all-reduce of that many bytes of float32 over every rank
  (after ``warmup`` untimed ones at every size first -- a new group's first collectives are slow --
  and ``warmup`` more; each timed one starts after a barrier, so no rank measures another's
  lateness);
- ``p2p``: half the median round trip of a send from rank 0 to rank 1 and back (one-way time);
- ``msgplane`` (with ``secret``): half the median round trip of a message-plane call from rank 0
  to a server on rank 1 (``comm/msgplane.py``: signed frames over ZeroMQ, the path of parameter
  server pushes and pulls and of AD-PSGD's exchanges) carrying that many bytes each way -- what
  the runtime's software adds to a transfer over the same loopback.  The server's address goes
  through the store; the secret only through the arguments (never a socket).

The other ranks return ``None``.  Everything is a ``CollectiveError`` on failure, with the group
closed.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from flotilla.comm.collective import Group
from flotilla.comm.endpoint import Reply, Request
from flotilla.comm.msgplane import connect, serve
from flotilla.comm.store import StoreAddress, connect_store
from flotilla.core.errors import CollectiveError, CommError

__all__ = ["measure"]


def _timed(fn: Any, repeats: int, warmup: int, before: Any = None) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(
    address: StoreAddress, rank: int, world_size: int, sizes: list[int], *, repeats: int = 20,
    warmup: int = 3, timeout_s: float = 60.0, secret: bytes | None = None,
) -> dict[str, list[tuple[int, float]]] | None:  # fmt: skip
    """See the module doc."""
    store = connect_store(address, timeout_s=timeout_s)
    group = Group(store, namespace="calibrate", rank=rank, world_size=world_size, timeout_s=timeout_s)
    try:
        out: dict[str, list[tuple[int, float]]] = {"allreduce": [], "p2p": []}
        for size in sizes:  # (a new group's first collectives are slow: warm every size up once)
            t = torch.zeros(max(1, size // 4), dtype=torch.float32)
            for _ in range(warmup):
                group.allreduce(t)
        for size in sizes:
            t = torch.zeros(max(1, size // 4), dtype=torch.float32)
            took = _timed(lambda t=t: group.allreduce(t), repeats, warmup, before=group.barrier)
            out["allreduce"].append((t.numel() * 4, took))
        for size in sizes:
            t = torch.zeros(max(1, size // 4), dtype=torch.float32)
            if rank == 0:

                def ping(t: torch.Tensor = t) -> None:
                    group.send(t, 1).wait()
                    group.recv(t, 1).wait()

                rtt = _timed(ping, repeats, warmup)
                out["p2p"].append((t.numel() * 4, rtt / 2))
            elif rank == 1:

                def pong(t: torch.Tensor = t) -> None:
                    group.recv(t, 0).wait()
                    group.send(t, 0).wait()

                for _ in range(warmup + repeats):
                    pong()
            group.barrier()
        if secret is not None:
            msgplane = _message_plane(store, group, rank, sizes, secret, repeats, warmup, timeout_s)
            if rank == 0:
                out["msgplane"] = msgplane
        return out if rank == 0 else None
    finally:
        group.close()


_ADDRESS_KEY = "calibrate/msgplane"


def _message_plane(
    store: Any, group: Group, rank: int, sizes: list[int], secret: bytes, repeats: int, warmup: int,
    timeout_s: float,
) -> list[tuple[int, float]]:  # fmt: skip
    """Rank 1 serves an echo; rank 0 times calls carrying each size both ways (module doc)."""
    out: list[tuple[int, float]] = []
    if rank == 1:
        server = serve(secret, "tcp://127.0.0.1:0", name="calibrate")

        def echo(req: Request) -> Reply:
            return Reply(body={}, tensors=list(req.tensors))

        server.register("echo", echo, {}, max_tensors=1)
        server.start()
        try:
            store.set(_ADDRESS_KEY, server.address.encode())
            for _ in sizes:  # (one barrier per size: no single wait as long as the whole series)
                group.barrier()
        finally:
            server.close()
    elif rank == 0:
        client = connect(store.get(_ADDRESS_KEY).decode(), secret, sender="calibrate")
        failed: CommError | None = None
        try:
            for size in sizes:
                if failed is None:
                    t = torch.zeros(max(1, size // 4), dtype=torch.float32)
                    try:
                        rtt = _timed(
                            lambda t=t: client.call("echo", {}, [t], timeout_s=timeout_s), repeats, warmup
                        )
                        out.append((t.numel() * 4, rtt / 2))
                    except CommError as exc:  # (still at every barrier: rank 1 is not left waiting)
                        failed = exc
                group.barrier()
        finally:
            client.close()
        if failed is not None:
            raise CollectiveError(f"message-plane calibration failed: {failed}") from None
    else:
        for _ in sizes:
            group.barrier()
    return out
