"""The job's end at a real coordinator over the message plane: the standby a finished worker is
told of (in the reply to its finished ``leave`` and in its heartbeats: ``rendezvous.standby``),
a finished ``leave`` naming an unknown worker answered as before, and ``fail_job`` taken neither
from a worker the job is rid of nor after the job's result."""

from __future__ import annotations

import pytest

from flotilla.comm.auth import generate_secret
from flotilla.comm.msgplane import connect
from flotilla.config import load_config
from flotilla.roles.coordinator import Coordinator

pytestmark = pytest.mark.timeout(60)


def _join(client, name: str) -> int:
    body = {
        "name": name,
        "speed": None,
        "pid": 1,
        "peer_address": None,
        "live_port": None,
        "join_token": None,
    }
    return int(client.call("join", body).body["worker_id"])


def _beat(client, wid: int) -> dict:
    body = {"worker_id": wid, "batch": 1, "records": [], "lease": None, "ring": None, "runs": 0}
    return client.call("heartbeat", body).body


def test_the_last_finisher_is_told_it_stands_by_and_fail_job_is_refused_from_the_dead_and_after_the_end() -> (
    None
):
    secret = generate_secret()
    coord = Coordinator(load_config("examples/tiny.yaml", ["cluster.num_workers=4"]), secret).start()
    client = connect(coord.address, secret, sender="t")
    try:
        w0, w1, w2, w3 = (_join(client, n) for n in ("w0", "w1", "w2", "w3"))
        assert "standby" not in client.call("leave", {"worker_id": 99, "finished": True}).body  # (unknown)
        # a dead worker's fail_job (its message late, or forged) changes nothing
        coord.remove_worker("w3", "process exited with code 1")
        dead = {"worker_id": w3, "reason": "late", "step": 3, "own": True, "model_file": None}
        assert client.call("fail_job", dead).body == {"ok": False}
        assert coord.snapshot()["stop"] is False
        # w1 finishes while w2 trains: nobody stands by, it may leave at once
        assert client.call("leave", {"worker_id": w1, "finished": True}).body["standby"] is None
        assert _beat(client, w1)["standby"] is None and "standby" not in _beat(client, w2)
        # w2 finishes: only w0 (due to report: it never says done) is left to talk -- w2 stands by
        assert client.call("leave", {"worker_id": w2, "finished": True}).body["standby"] == w2
        assert _beat(client, w2)["standby"] == w2 and _beat(client, w1)["standby"] == w2
        assert "standby" not in _beat(client, w0)
        # the job's result, then a fail_job: the result stands
        client.call("finish", {"worker_id": w0, "result": {"steps": 5}})
        late = {"worker_id": w2, "reason": "after the end", "step": 5, "own": True, "model_file": None}
        assert client.call("fail_job", late).body == {"ok": False}
        assert coord.snapshot().get("error") is None and _beat(client, w2)["standby"] is None
    finally:
        client.close()
        coord.close()
