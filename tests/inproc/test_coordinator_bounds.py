"""Signed extreme values sent to a real coordinator over the message plane: every int field of
its protocol has a stated bound (``roles/coordinator.py``, docs/messaging.md), so a correctly
signed 2^63-1 (or -1) is rejected (``schema``) before a handler sees it, and the coordinator
goes on serving the honest workers unharmed.  The rejections are counted in its snapshot."""

from __future__ import annotations

import pytest

from flotilla.comm.auth import generate_secret
from flotilla.comm.msgplane import connect
from flotilla.config import load_config
from flotilla.core.errors import RemoteError
from flotilla.report.summary import run_summary
from flotilla.roles.coordinator import Coordinator

pytestmark = pytest.mark.timeout(60)

BIG = 2**63 - 1

EXTREMES = [
    ("heartbeat", {"worker_id": BIG, "batch": 1, "records": [], "lease": None, "ring": None, "runs": 0}),
    ("heartbeat", {"worker_id": 0, "batch": BIG, "records": [], "lease": None, "ring": None, "runs": 0}),
    ("heartbeat", {"worker_id": -1, "batch": 1, "records": [], "lease": None, "ring": None, "runs": 0}),
    ("heartbeat", {"worker_id": 0, "batch": 1, "records": [], "lease": "soon", "ring": None, "runs": 0}),
    ("heartbeat", {"worker_id": 0, "batch": 1, "records": [], "lease": None, "ring": None, "runs": -1}),
    ("heartbeat", {"worker_id": 0, "batch": 1, "records": [], "lease": None, "ring": [1, 2], "runs": 0}),
    ("poll_view", {"worker_id": 0, "after_epoch": BIG, "adopt": True}),
    ("get_view", {"worker_id": 0, "epoch": -5}),
    ("suspect", {"worker_id": 0, "epoch": BIG, "suspects": [1], "closed": True}),
    ("leave", {"worker_id": BIG}),
    (
        "join",
        {
            "name": "evil",
            "speed": None,
            "pid": BIG,
            "peer_address": None,
            "live_port": None,
            "join_token": None,
        },
    ),
    (
        "join",
        {
            "name": "evil",
            "speed": None,
            "pid": 1,
            "peer_address": None,
            "live_port": 70000,
            "join_token": None,
        },
    ),
    ("fail_job", {"worker_id": 0, "reason": "x", "step": BIG, "own": True, "model_file": None}),
]


def test_signed_extreme_values_are_rejected_and_change_nothing() -> None:
    secret = generate_secret()
    coord = Coordinator(load_config("examples/tiny.yaml", ["cluster.num_workers=2"]), secret).start()
    client = connect(coord.address, secret, sender="w0")
    try:
        join = {
            "name": "w0",
            "speed": None,
            "pid": 1,
            "peer_address": None,
            "live_port": None,
            "join_token": None,
        }
        wid = client.call("join", join).body
        before = coord.snapshot()
        for op, body in EXTREMES:
            with pytest.raises(RemoteError) as info:
                client.call(op, body, timeout_s=10)
            assert info.value.code == "schema", (op, body, info.value)
        with pytest.raises(RemoteError, match="join_token must be 16 to 64 hex digits"):
            client.call("join", {**join, "name": "evil", "join_token": "z" * 5000}, timeout_s=10)
        after = coord.snapshot()
        assert after["members"] == before["members"] and after["latest_epoch"] == before["latest_epoch"]
        assert sum(after["rejections"]["schema"].values()) >= len(EXTREMES)
        assert run_summary(after, strategy="allreduce")["rejections"]["schema"] >= len(EXTREMES)
        # the honest worker is served as before
        hb = {"worker_id": wid["worker_id"], "batch": 1, "records": []}
        hb.update(lease=None, ring=None, runs=0)
        for ring in ({"epoch": -1, "members": [0]}, {"epoch": 2, "members": [BIG]}, {"epoch": 2}):
            with pytest.raises(RemoteError, match="bad_request: ring"):  # (a ring view out of bounds)
                client.call("heartbeat", {**hb, "ring": ring}, timeout_s=10)
        assert coord.snapshot()["latest_epoch"] == before["latest_epoch"]
        reply = client.call("heartbeat", hb).body
        assert reply["stop"] is False and reply["epoch"] == before["latest_epoch"]
    finally:
        client.close()
        coord.close()
