"""Moving a structured state (msgpack metadata and a list of tensors) from one member of a
:class:`~flotilla.comm.collective.Group` to the others: how a view's newcomers receive the model,
optimizer and strategy state (``trainer/state_sync.py``) and how pipeline replicas share their
losses (``roles/stage_replicas.py``).

Invariants: no pickle -- the metadata travels as msgpack bytes in a uint8 tensor; a receiver
refuses a header over 64 MiB and any tensor dtype outside ``core.dtypes.REAL_DTYPES`` with
``CollectiveError`` before allocating anything from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgpack
import torch

from flotilla.comm.collective import Group
from flotilla.core.dtypes import REAL_DTYPES
from flotilla.core.errors import CollectiveError

__all__ = ["ALONE_BYTES", "BUCKET_BYTES", "broadcast_state", "buckets"]

_STATE_DTYPES = REAL_DTYPES


BUCKET_BYTES = 4 * 1024 * 1024  # small tensors travel packed in buckets of one dtype up to this size
ALONE_BYTES = 1024 * 1024  # a tensor this big travels alone (no copy: its launch is worth it)


def broadcast_state(
    group: Group, src: int, meta: dict | None, tensors: Sequence[torch.Tensor] | None
) -> tuple[dict, list[torch.Tensor]]:
    """Broadcast a msgpack-able ``meta`` dict and a list of tensors from rank ``src``.

    Receivers pass ``None`` for both; they learn shapes and dtypes from ``meta`` (which the sender
    extends with a ``_tensors`` descriptor list) and get freshly allocated tensors back (views
    into the buckets they arrived in).  No pickle: the metadata travels as msgpack bytes in a
    uint8 tensor.  The small tensors travel packed: consecutive tensors of one dtype under
    ``ALONE_BYTES`` share a flat bucket of up to ``BUCKET_BYTES`` (:func:`buckets`), one broadcast
    each -- a state of hundreds of small tensors is a handful of launches, not hundreds; a big
    tensor goes alone, without a copy (``benchmarks/state_transfer.py``).
    """
    if group.rank == src:
        assert meta is not None and tensors is not None
        desc = [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for t in tensors]
        payload = msgpack.packb({"meta": meta, "tensors": desc}, use_bin_type=True)
        length = torch.tensor([len(payload)], dtype=torch.int64)
        group.broadcast([length], src)
        group.broadcast([torch.frombuffer(bytearray(payload), dtype=torch.uint8)], src)
        spans = buckets([(t.dtype, t.numel()) for t in tensors])
        flats = [_flat([tensors[i] for i in span]) for span in spans]
        group.broadcast(flats, src)
        return meta, list(tensors)
    length = torch.zeros(1, dtype=torch.int64)
    group.broadcast([length], src)
    if not 0 < int(length) <= 64 * 1024 * 1024:
        raise CollectiveError(f"state header of {int(length)} bytes is out of range")
    buf = torch.empty(int(length), dtype=torch.uint8)
    group.broadcast([buf], src)
    decoded = msgpack.unpackb(buf.numpy().tobytes(), raw=False)
    kinds: list[tuple[torch.dtype, list[int]]] = []
    for d in decoded["tensors"]:
        if d["dtype"] not in _STATE_DTYPES:
            raise CollectiveError(f"state tensor dtype {d['dtype']!r} is not allowed")
        kinds.append((getattr(torch, d["dtype"]), [int(n) for n in d["shape"]]))
    sizes = [(dtype, math.prod(shape)) for dtype, shape in kinds]
    spans = buckets(sizes)
    flats = [torch.empty(sum(sizes[i][1] for i in span), dtype=sizes[span[0]][0]) for span in spans]
    group.broadcast(flats, src)
    out: list[torch.Tensor] = []
    for span, flat in zip(spans, flats, strict=True):
        offset = 0
        for i in span:
            n = sizes[i][1]
            out.append(flat[offset : offset + n].view(kinds[i][1]))
            offset += n
    return decoded["meta"], out


def buckets(
    sizes: Sequence[tuple[torch.dtype, int]], limit: int = BUCKET_BYTES, alone: int = ALONE_BYTES
) -> list[list[int]]:
    """The tensors (``(dtype, elements)`` in order) grouped into buckets that travel as one flat
    tensor each: consecutive tensors of one dtype, each under ``alone`` bytes, at most ``limit``
    bytes together; a tensor of ``alone`` bytes or more is a bucket of its own."""
    out: list[list[int]] = []
    nbytes = 0
    packing = False  # (whether the last bucket takes more small tensors)
    for i, (dtype, n) in enumerate(sizes):
        size = n * torch.empty((), dtype=dtype).element_size()
        small = size < alone
        if packing and small and sizes[out[-1][0]][0] == dtype and nbytes + size <= limit:
            out[-1].append(i)
            nbytes += size
        else:
            out.append([i])
            nbytes, packing = size, small
    return out


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One bucket as a flat tensor (a tensor alone: itself, flattened, no copy if contiguous)."""
    if len(tensors) == 1:
        return tensors[0].detach().reshape(-1)
    return torch.cat([t.detach().reshape(-1) for t in tensors])
