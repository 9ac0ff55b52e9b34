"""Wire format of the message plane: a message is a list of byte frames.

    frame 0   msgpack header (a map; ``tensors`` lists one ``{dtype, shape}`` per tensor frame)
    frame 1   HMAC-SHA256 tag over frame 0 and every tensor frame (``flotilla.comm.auth.sign``)
    frame 2.. raw bytes of each tensor, C-contiguous, native (little-endian) byte order

Invariants:
- No pickle: headers are msgpack of plain types, tensors are raw bytes plus a whitelisted dtype.
- ``decode`` checks, in this order and before allocating anything: frame count, total bytes,
  header bytes, HMAC tag, msgpack decoding under strict limits, header structure (version, tensor
  descriptors: known dtype, non-negative shape, ndim, byte length).  A failure raises
  ``MessageRejected`` with code ``oversized`` / ``auth`` / ``malformed`` and allocates nothing.
- Zero copy both ways: ``encode`` returns a ``memoryview`` of each (contiguous) tensor's storage;
  ``decode`` wraps each received buffer with ``torch.frombuffer`` (copying only a misaligned
  buffer).  A decoded tensor therefore aliases its receive buffer.
- Fields of the header beyond ``v`` and ``tensors`` are checked by the endpoint layer.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import msgpack
import torch

from flotilla.comm import auth
from flotilla.core.dtypes import DTYPE_ITEMSIZE
from flotilla.core.errors import ConfigError, MessageRejected

__all__ = ["DTYPES", "WIRE_VERSION", "Limits", "decode", "encode", "peek_header", "tensor_frame"]

WIRE_VERSION = 1
PEEK_BYTES = 2048
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_ITEMSIZE}
"""The wire whitelist (:data:`flotilla.core.dtypes.WIRE_DTYPES`) as torch dtypes."""
_DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}
_TAG_PLACEHOLDER = bytes(auth.TAG_BYTES)
Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """Bounds every endpoint enforces on incoming messages (and its own outgoing ones)."""

    max_message_bytes: int = 256 * 1024 * 1024
    max_frames: int = 4096
    max_header_bytes: int = 64 * 1024
    max_tensor_ndim: int = 8
    replay_window_s: float = 60.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            kinds = (int, float) if f.name.endswith("_s") else (int,)
            if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
                what = "number" if f.name.endswith("_s") else "int"
                raise ConfigError(f"Limits.{f.name}: must be a positive {what}, got {value!r}")
        if self.max_frames < 2:
            raise ConfigError(f"Limits.max_frames: must be >= 2, got {self.max_frames}")
        if self.max_header_bytes > self.max_message_bytes:
            raise ConfigError(
                "Limits.max_header_bytes: must be <= max_message_bytes "
                f"({self.max_message_bytes}), got {self.max_header_bytes}"
            )


def _nbytes(buf: Buffer) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def tensor_frame(t: torch.Tensor) -> tuple[dict[str, Any], memoryview]:
    """Descriptor and zero-copy byte view of ``t`` (made CPU, dense and contiguous if needed)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensors: expected torch.Tensor, got {type(t).__name__}")
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise TypeError(f"tensors: dtype {t.dtype} not supported; allowed: {sorted(DTYPES)}")
    if t.layout != torch.strided:
        raise TypeError(f"tensors: layout {t.layout} not supported; only strided tensors")
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    flat = t.reshape(-1).view(torch.uint8)
    return {"dtype": name, "shape": list(t.shape)}, flat.numpy().data


def encode(
    header: Mapping[str, Any],
    tensors: Sequence[torch.Tensor],
    *,
    secret: bytes,
    domain: bytes,
    limits: Limits,
) -> list[Buffer]:
    """Frames ``[header, tag, *tensor bytes]``; ``header['tensors']`` is filled in here.

    Raises ``MessageRejected("oversized")`` if the result would break ``limits`` (so a sender
    learns it at once instead of by a rejection), ``TypeError`` for non-msgpack body values.
    """
    descriptors, buffers = [], []
    for t in tensors:
        desc, buf = tensor_frame(t)
        descriptors.append(desc)
        buffers.append(buf)
    head = msgpack.packb({**header, "tensors": descriptors}, use_bin_type=True)
    _check_sizes([head, _TAG_PLACEHOLDER, *buffers], limits)
    return [head, auth.sign(secret, domain, [head, *buffers]), *buffers]


def _check_sizes(frames: Sequence[Buffer], limits: Limits) -> None:
    if len(frames) > limits.max_frames:
        raise MessageRejected("oversized", f"{len(frames)} frames > max_frames {limits.max_frames}")
    total = sum(_nbytes(f) for f in frames)
    if total > limits.max_message_bytes:
        raise MessageRejected("oversized", f"{total} bytes > max_message_bytes {limits.max_message_bytes}")
    if frames and _nbytes(frames[0]) > limits.max_header_bytes:
        raise MessageRejected(
            "oversized",
            f"header of {_nbytes(frames[0])} bytes > max_header_bytes {limits.max_header_bytes}",
        )


def _unpack(head: Buffer, limits: Limits) -> Any:
    n = limits.max_header_bytes
    return msgpack.unpackb(
        head,
        raw=False,
        strict_map_key=True,
        use_list=True,
        max_str_len=n,
        max_bin_len=n,
        max_array_len=n,
        max_map_len=n // 2,
        max_ext_len=0,
    )


def peek_header(frames: Sequence[Buffer], limits: Limits) -> dict[str, Any]:
    """Leading fields of the *unauthenticated* header that fit in its first ``PEEK_BYTES``.

    Bounded work whatever the frame size.  Only for logging a rejection and routing its error
    reply (``rid``) back to the peer that sent it; never trust the content.  Senders therefore
    put ``rid``, ``op``/``ok`` and ``sender`` first.
    """
    out: dict[str, Any] = {}
    if not frames:
        return out
    n = min(PEEK_BYTES, limits.max_header_bytes)
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=n, max_ext_len=0)
    try:
        unpacker.feed(memoryview(frames[0])[:n])
        for _ in range(min(unpacker.read_map_header(), 16)):
            key, value = unpacker.unpack(), unpacker.unpack()
            if isinstance(key, str):
                out[key] = value
    except Exception:
        pass  # truncated or garbage: keep what was read
    return out


def decode(
    frames: Sequence[Buffer], *, secret: bytes, domain: bytes, limits: Limits
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Check and decode ``frames``; returns the header map and the tensors (zero copy)."""
    if len(frames) < 2:
        raise MessageRejected("malformed", f"{len(frames)} frames; need header and tag")
    _check_sizes(frames, limits)
    head, tag, payload = frames[0], frames[1], frames[2:]
    if not auth.verify(secret, domain, [head, *payload], tag):
        raise MessageRejected("auth", "bad HMAC tag (wrong secret or altered message)")
    try:
        header = _unpack(head, limits)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        raise MessageRejected("malformed", f"header is not valid msgpack ({reason})") from None
    specs = _check_header(header, payload, limits)
    return header, [_to_tensor(buf, dtype, shape) for buf, (dtype, shape) in zip(payload, specs)]


def _check_header(
    header: Any, payload: Sequence[Buffer], limits: Limits
) -> list[tuple[torch.dtype, list[int]]]:
    if not isinstance(header, dict):
        raise MessageRejected("malformed", f"header must be a map, got {type(header).__name__}")
    version = header.get("v")
    if type(version) is not int or version != WIRE_VERSION:
        raise MessageRejected("malformed", f"header.v must be {WIRE_VERSION}, got {version!r}")
    descriptors = header.get("tensors")
    if not isinstance(descriptors, list):
        raise MessageRejected("malformed", "header.tensors must be a list")
    if len(descriptors) != len(payload):
        raise MessageRejected(
            "malformed", f"{len(descriptors)} tensor descriptors for {len(payload)} tensor frames"
        )
    return [_check_descriptor(i, d, payload[i], limits) for i, d in enumerate(descriptors)]


def _check_descriptor(i: int, desc: Any, buf: Buffer, limits: Limits) -> tuple[torch.dtype, list[int]]:
    where = f"header.tensors[{i}]"
    if not isinstance(desc, dict) or set(desc) != {"dtype", "shape"}:
        raise MessageRejected("malformed", f"{where} must be a map with keys dtype, shape")
    dtype = DTYPES.get(desc["dtype"]) if isinstance(desc["dtype"], str) else None
    if dtype is None:
        raise MessageRejected("malformed", f"{where}.dtype {desc['dtype']!r} is not a known dtype")
    shape = desc["shape"]
    if not isinstance(shape, list) or len(shape) > limits.max_tensor_ndim:
        raise MessageRejected(
            "malformed", f"{where}.shape must be a list of at most {limits.max_tensor_ndim} dims"
        )
    for dim in shape:
        if type(dim) is not int or not 0 <= dim <= limits.max_message_bytes:
            raise MessageRejected("malformed", f"{where}.shape has a bad dimension {dim!r}")
    expected = math.prod(shape) * dtype.itemsize
    if expected != _nbytes(buf):
        raise MessageRejected("malformed", f"{where} needs {expected} bytes, its frame has {_nbytes(buf)}")
    return dtype, shape


def _to_tensor(buf: Buffer, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if _nbytes(buf) == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # A read-only buffer (bytes) is wrapped anyway; the warning is about writing to it.
        warnings.filterwarnings("ignore", message=".*buffer is not writable.*")
        t = torch.frombuffer(buf, dtype=dtype)
    if t.data_ptr() % dtype.itemsize:
        t = t.clone()  # misaligned receive buffer: one aligned copy
    return t.reshape(shape)
