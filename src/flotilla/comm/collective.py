"""Collective plane: one torch process group per membership epoch, never the global default group.

Invariants
- A group is created for exactly one ``(epoch, members)`` pair through a store whose keys carry
  the prefix ``epoch/<n>/``, so groups of different epochs never see each other's rendezvous keys.
- Every collective has a timeout: the group's default (``timeout_s``) and an explicit wait bound.
- ``close()`` releases the group in-process (gloo threads and sockets), so a survivor can build
  the next epoch's group without restarting.
- Failures surface as :class:`~flotilla.core.errors.CollectiveError`; callers treat them as normal
  control flow (the step is discarded, SPEC §7).
"""

from __future__ import annotations

import datetime as _dt
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from flotilla.core.dtypes import REAL_DTYPES
from flotilla.core.errors import CollectiveError

_STATE_DTYPES = REAL_DTYPES
_OPS: dict[str, Any] = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _td(seconds: float) -> _dt.timedelta:
    return _dt.timedelta(seconds=seconds)


@dataclass(frozen=True, slots=True)
class StoreAddress:
    host: str
    port: int


class StoreHost:
    """The rendezvous store hosted by the coordinator (torch ``TCPStore``, master side).

    ``TCPStore`` alone listens on every interface; we bind the listening socket ourselves to
    ``host`` (127.0.0.1 by default) and hand it over, so the store is reachable only there.
    The store is not authenticated: keep ``host`` on a trusted network.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0) -> None:
        sock = socket.create_server((host, port), backlog=128)
        bound_port = sock.getsockname()[1]
        try:
            self._store: dist.TCPStore | None = dist.TCPStore(
                host,
                bound_port,
                is_master=True,
                wait_for_workers=False,
                timeout=_td(timeout_s),
                use_libuv=True,
                master_listen_fd=sock.fileno(),
            )
        except BaseException:
            sock.close()
            raise
        sock.detach()  # the store owns (and closes) the listening descriptor now
        self.address = StoreAddress(host, bound_port)

    def close(self) -> None:
        self._store = None  # the server thread stops when the last reference goes


def connect_store(address: StoreAddress, timeout_s: float = 30.0) -> dist.Store:
    """A client connection to the coordinator's store."""
    try:
        return dist.TCPStore(
            address.host, address.port, is_master=False, timeout=_td(timeout_s), use_libuv=True
        )
    except Exception as exc:  # torch raises RuntimeError / DistStoreError
        raise CollectiveError(f"cannot reach store {address.host}:{address.port}: {exc}") from exc


class Handle:
    """An in-flight collective; ``wait`` raises CollectiveError on failure or timeout, then runs
    ``after`` (copying a staged result back into the caller's tensor)."""

    def __init__(self, work: Any, timeout_s: float, after: Callable[[], Any] | None = None) -> None:
        self._work = work
        self._timeout_s = timeout_s
        self._after = after

    def wait(self) -> None:
        try:
            self._work.wait(_td(self._timeout_s))
        except Exception as exc:
            raise CollectiveError(f"collective failed: {exc}") from exc
        if self._after is not None:
            self._after()


class EpochGroup:
    """A gloo (CPU) or NCCL (CUDA) process group for one membership epoch."""

    def __init__(
        self,
        store: dist.Store,
        *,
        epoch: int,
        rank: int,
        world_size: int,
        timeout_s: float = 30.0,
        backend: str = "gloo",
        rendezvous_timeout_s: float | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``timeout_s`` bounds every collective; ``rendezvous_timeout_s`` (default
        ``2 * timeout_s + 5``) bounds group creation.  It is longer on purpose: after a failure,
        one survivor may still be blocked in the old group's collective for up to ``timeout_s``
        while the others already wait for it in the new group.

        ``backend="nccl"`` needs ``device`` (this rank's GPU, one GPU per rank): tensors that live
        elsewhere (the small CPU votes and probes, received state) are staged through it."""
        if backend == "nccl" and (device is None or device.type != "cuda"):  # (gloo ignores device)
            raise ValueError(f"backend nccl needs a cuda device, got {device!r}")
        self._device = device if backend == "nccl" else None
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.epoch, self.rank, self.world_size = epoch, rank, world_size
        self.timeout_s = timeout_s
        prefixed = dist.PrefixStore(f"epoch/{epoch}/", store)
        rdv_s = rendezvous_timeout_s if rendezvous_timeout_s is not None else 2 * timeout_s + 5
        try:
            if backend == "gloo":
                self._pg: Any = dist.ProcessGroupGloo(prefixed, rank, world_size, _td(rdv_s))
                self._pg._set_default_timeout(_td(timeout_s))
            elif backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = _td(rdv_s)
                self._pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
            else:
                raise ValueError(f"backend must be one of gloo, nccl; got {backend!r}")
        except ValueError:
            raise
        except Exception as exc:
            raise CollectiveError(f"epoch {epoch}: group rendezvous failed: {exc}") from exc

    @property
    def process_group(self) -> object:
        """The raw torch *backend* object (gloo/NCCL), not a ``ProcessGroup``.

        Torch components that want a ``ProcessGroup`` (DDP) need it wrapped; see
        ``benchmarks/ssgd_vs_ddp.py::_as_process_group``.
        """
        return self._pg

    def _check_open(self) -> None:
        if self._pg is None:
            raise CollectiveError(f"epoch {self.epoch}: group is closed")

    def _staged(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], Any] | None]:
        """``tensor`` on the group's device, and how to copy a result back (None: no staging)."""
        if self._device is None or tensor.device == self._device:
            return tensor, None
        staged = tensor.to(self._device)
        return staged, lambda: tensor.copy_(staged)

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Handle:
        self._check_open()
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[op]
        opts.timeout = _td(self.timeout_s)
        staged, back = self._staged(tensor)
        try:
            return Handle(self._pg.allreduce([staged], opts), self.timeout_s, back)
        except Exception as exc:
            raise CollectiveError(f"allreduce launch failed: {exc}") from exc

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.allreduce_async(tensor, op).wait()
        return tensor

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        self._check_open()
        for t in tensors:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = src, 0
            opts.timeout = _td(self.timeout_s)
            staged, back = self._staged(t)
            try:
                Handle(self._pg.broadcast([staged], opts), self.timeout_s, back).wait()
            except CollectiveError:
                raise
            except Exception as exc:
                raise CollectiveError(f"broadcast failed: {exc}") from exc

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        self._check_open()
        staged, _ = self._staged(tensor)
        return Handle(self._pg.send([staged], dst, tag), self.timeout_s)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        self._check_open()
        staged, back = self._staged(tensor)
        return Handle(self._pg.recv([staged], src, tag), self.timeout_s, back)

    def barrier(self) -> None:
        flag = torch.zeros(1)
        self.allreduce(flag)

    def close(self) -> None:
        """Release the group; idempotent.  In-flight work is abandoned."""
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:
                pass
            del pg


# ----------------------------------------------------------------- structured state broadcast


def broadcast_state(
    group: EpochGroup, src: int, meta: dict | None, tensors: Sequence[torch.Tensor] | None
) -> tuple[dict, list[torch.Tensor]]:
    """Broadcast a msgpack-able ``meta`` dict and a list of tensors from rank ``src``.

    Receivers pass ``None`` for both; they learn shapes and dtypes from ``meta`` (which the sender
    extends with a ``_tensors`` descriptor list) and get freshly allocated tensors back.  No pickle:
    the metadata travels as msgpack bytes in a uint8 tensor.
    """
    if group.rank == src:
        assert meta is not None and tensors is not None
        desc = [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for t in tensors]
        payload = msgpack.packb({"meta": meta, "tensors": desc}, use_bin_type=True)
        length = torch.tensor([len(payload)], dtype=torch.int64)
        group.broadcast([length], src)
        group.broadcast([torch.frombuffer(bytearray(payload), dtype=torch.uint8)], src)
        group.broadcast([t.detach().contiguous() for t in tensors], src)
        return meta, list(tensors)
    length = torch.zeros(1, dtype=torch.int64)
    group.broadcast([length], src)
    if not 0 < int(length) <= 64 * 1024 * 1024:
        raise CollectiveError(f"state header of {int(length)} bytes is out of range")
    buf = torch.empty(int(length), dtype=torch.uint8)
    group.broadcast([buf], src)
    decoded = msgpack.unpackb(buf.numpy().tobytes(), raw=False)
    out = []
    for d in decoded["tensors"]:
        if d["dtype"] not in _STATE_DTYPES:
            raise CollectiveError(f"state tensor dtype {d['dtype']!r} is not allowed")
        out.append(torch.empty([int(n) for n in d["shape"]], dtype=getattr(torch, d["dtype"])))
    group.broadcast(out, src)
    return decoded["meta"], out
