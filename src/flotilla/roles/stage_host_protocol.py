"""The pipeline host's message-plane protocol (``roles/stage_host.py``): each op's body schema, with
the stated bound of every integer a stage worker may send (``docs/messaging.md``), the limits of
its frames, and what the host hands its launcher (:class:`HostView`).  The message plane checks a
body against its schema before the handler runs: a body out of bounds changes no state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flotilla.comm.codec import Limits
from flotilla.comm.schema import IntRange

__all__ = ["BODIES", "FAILURE_CAUSES", "HOST_LIMITS", "HostView", "STATES", "WEIGHTS_CHUNK_BYTES"]

WEIGHTS_CHUNK_BYTES = 32 * 2**20  # a stage's weights travel in chunks of this size
HOST_LIMITS = Limits(max_message_bytes=WEIGHTS_CHUNK_BYTES + 2**20, max_header_bytes=4 * 2**20)
MAX_WEIGHTS_BYTES = 2**40
_INDEX = IntRange(0, 2**16)
_COUNTER = IntRange(-1, 2**62)
STATES = ("training", "done", "nonfinite")
FAILURE_CAUSES = ("own", "group")

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
