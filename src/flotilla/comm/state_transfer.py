"""Moving a structured state (msgpack metadata and a list of tensors) from one member of a
:class:`~flotilla.comm.collective.Group` to the others: how a view's newcomers receive the model,
optimizer and strategy state (``trainer/state_sync.py``) and how pipeline replicas share their
losses (``roles/stage_replicas.py``).

Invariants: no pickle -- the metadata travels as msgpack bytes in a uint8 tensor; a receiver
refuses a header over 64 MiB and any tensor dtype outside ``core.dtypes.REAL_DTYPES`` with
``CollectiveError`` before allocating anything from it.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgpack
import torch

from flotilla.comm.collective import Group
from flotilla.core.dtypes import REAL_DTYPES
from flotilla.core.errors import CollectiveError

__all__ = ["broadcast_state"]

_STATE_DTYPES = REAL_DTYPES


def broadcast_state(
    group: Group, src: int, meta: dict | None, tensors: Sequence[torch.Tensor] | None
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
