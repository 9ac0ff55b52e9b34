"""The pipeline host's message-plane protocol (``roles/stage_host.py``): each op's body schema, with
the stated bound of every integer a stage worker may send (``docs/messaging.md``), the limits of
its frames, what the host hands its launcher (:class:`HostView`), and the checks of what a stage
reports (its status, :func:`status_fields`; its weights in chunks, :class:`Upload`).  The message
plane checks a body against its schema before the handler runs: a body out of bounds changes no
state.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from flotilla.comm.codec import Limits
from flotilla.comm.schema import IntRange
from flotilla.core.errors import RemoteError

__all__ = [
    "BODIES",
    "FAILURE_CAUSES",
    "HOST_LIMITS",
    "HostView",
    "STATES",
    "Upload",
    "WEIGHTS_CHUNK_BYTES",
    "status_fields",
]

WEIGHTS_CHUNK_BYTES = 32 * 2**20  # a stage's weights travel in chunks of this size
HOST_LIMITS = Limits(max_message_bytes=WEIGHTS_CHUNK_BYTES + 2**20, max_header_bytes=4 * 2**20)
MAX_WEIGHTS_BYTES = 2**40
_INDEX = IntRange(0, 2**16)
_COUNTER = IntRange(-1, 2**62)
STATES = ("training", "done", "nonfinite")
FAILURE_CAUSES = ("own", "group", "task")  # (task: its task raised, job.on_error: stop -- the job stops)

BODIES: dict[str, dict[str, Any]] = {
    "stage_join": {
        "name": (str, None),
        "stage": (_INDEX, None),
        "instance": (_INDEX, None),
        "pid": IntRange(0, 2**22),
        "host": str,
        "join_token": str,
        "live_host": (str, None),  # its liveness listener (comm/liveness.py): its death seen at once
        "live_port": (IntRange(0, 65535), None),
    },
    "stage_beat": {
        "index": _INDEX,
        "token": str,
        "batch": _COUNTER,
        "records": list,
        "status": (dict, None),
    },
    "stage_weights": {
        "index": _INDEX,
        "token": str,
        "offset": IntRange(0, MAX_WEIGHTS_BYTES),
        "total": IntRange(1, MAX_WEIGHTS_BYTES),
    },
    "stage_result": {"index": _INDEX, "token": str, "result": dict, "weights_sha256": (str, None)},
    "stage_failed": {"index": _INDEX, "token": str, "cause": str, "line": str},
}


@dataclass(frozen=True)
class HostView:
    """What the launcher sees of the stages at one instant."""

    claimed: tuple[int, ...]
    missing: tuple[int, ...]
    results: tuple[int, ...]  # stage processes whose result (and weights) arrived
    failures: dict[int, tuple[str, str]]  # process -> (cause, line), in the order they came
    silent: tuple[int, ...]  # holders silent past the heartbeat timeout (not finished)
    dead: tuple[int, ...]  # holders whose process is gone (liveness connection closed; not finished)
    quiet: tuple[int, ...]  # holders silent for the ``quiet_s`` asked for (not finished), oldest first


_STATUS_KEYS = ("step", "loss", "state", "samples_per_s", "eval", "message")


def status_fields(st: Any) -> dict[str, Any] | None:
    """The fields of a stage's reported status the host writes, or None when it is malformed."""
    ok = (
        isinstance(st, dict)
        and type(st.get("step")) is int and st["step"] >= 0
        and st.get("state") in STATES
        and (st.get("loss") is None or isinstance(st["loss"], (int, float)))
        and isinstance(st.get("samples_per_s"), (int, float)) and math.isfinite(st["samples_per_s"])
        and isinstance(st.get("eval"), (dict, type(None)))
        and isinstance(st.get("message", ""), str)
    )  # fmt: skip
    return {k: st[k] for k in _STATUS_KEYS if k in st} if ok else None


@dataclass
class Upload:
    """A stage's weights arriving in chunks (``stage_weights``), checked whole at its result."""

    total: int
    data: bytearray = field(default_factory=bytearray)

    def add(self, offset: int, total: int, chunk: Any) -> int:
        """Append ``chunk`` (one flat uint8 tensor) at ``offset``; the bytes received so far.  A
        chunk received already, byte for byte (sent again: its answer was lost), changes nothing.
        RemoteError (``bad_request``) for anything that does not continue this upload."""
        if not isinstance(chunk, torch.Tensor) or chunk.dtype != torch.uint8 or chunk.dim() != 1:
            raise RemoteError("bad_request", "stage_weights: expected one flat uint8 tensor")
        end = offset + chunk.numel()
        if self.total == total and 0 <= offset < end <= len(self.data):
            if self.data[offset:end] == chunk.numpy().tobytes():
                return len(self.data)
        if self.total != total or offset != len(self.data) or offset + chunk.numel() > total:
            raise RemoteError("bad_request", f"stage_weights: chunk at {offset} does not continue the upload")
        self.data += chunk.numpy().tobytes()
        return len(self.data)

    def whole(self, sha256: str) -> bool:
        return len(self.data) == self.total and hashlib.sha256(self.data).hexdigest() == sha256
