"""The coordinator's message-plane protocol: each op's body schema, with the stated bound of every
integer a worker may send (docs/messaging.md, docs/security.md).  The message plane checks a body
against its schema before the handler runs: a body out of bounds is rejected (``schema``) and
changes no state, even when correctly signed.
"""

from __future__ import annotations

from typing import Any

from flotilla.comm.schema import IntRange

__all__ = ["BODIES"]

_WORKER_ID = IntRange(0, 2**31 - 1)
_EPOCH = IntRange(0, 2**53)
_COUNTER = IntRange(-1, 2**62)  # a heartbeat's batch number, a step
_PID = IntRange(0, 2**22)  # Linux's PID_MAX_LIMIT

BODIES: dict[str, dict[str, Any]] = {
    "join": {
        "name": (str, None),
        "speed": (float, None),
        "pid": _PID,
        "peer_address": (str, None),
        "live_port": (IntRange(0, 65535), None),  # its liveness listener (comm/liveness.py)
        "join_token": (str, None),  # the worker's own random token: a repeated join is the same one
    },
    "suspect": {"worker_id": _WORKER_ID, "epoch": _EPOCH, "suspects": list, "closed": bool},
    "poll_view": {"worker_id": _WORKER_ID, "after_epoch": _EPOCH, "adopt": bool},
    "get_view": {"worker_id": _WORKER_ID, "epoch": _EPOCH},
    "leave": {"worker_id": _WORKER_ID, "finished": (bool, None)},  # finished: its last step trained
    "heartbeat": {
        "worker_id": _WORKER_ID,
        "batch": _COUNTER,
        "records": list,
        "lease": (float, None),  # the newest lease stamp it received, echoed (cluster/lease.py)
        "ring": (dict, None),  # {epoch, members}: the view it runs in ring mode (the heal)
        "runs": _EPOCH,  # the epoch of the view it runs (0: none yet)
    },
    "finish": {"worker_id": _WORKER_ID, "result": dict},
    "fail_job": {
        "worker_id": _WORKER_ID,
        "reason": str,
        "step": _COUNTER,
        "own": bool,
        "model_file": (str, None),
    },
}
