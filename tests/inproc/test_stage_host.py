"""The pipeline job's host (``roles/stage_host.py``) over a real message plane: what a stage worker
may send, and what it may not.  A request from a worker that does not hold the process it names,
a body out of its schema, an unsigned frame, a malformed status or record, a broken weights upload:
each is refused or skipped and changes nothing, and the host goes on serving the honest stages."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from flotilla.comm import faulty
from flotilla.comm.auth import generate_secret
from flotilla.comm.faulty import NetFaults
from flotilla.comm.msgplane import connect
from flotilla.core.errors import CommError, RemoteError
from flotilla.elastic.checkpoint import tensors_bytes
from flotilla.report.metrics import read_jsonl
from flotilla.roles import stage_link
from flotilla.roles.stage_host import StageHost
from flotilla.roles.stage_link import StageLink
from flotilla.trainer.pipeline_job import StageJob

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def host(tmp_path: Path):
    job = StageJob(
        config={},
        store_host="",
        store_port=0,
        layer_ends=(2, 4),
        stage_names=("a", "b"),
        speeds=(1.0, 1.0),
        total_steps=5,
        run_dir=tmp_path / "run",
        report_dir=tmp_path / "report",
    )
    (tmp_path / "run").mkdir()
    secret = generate_secret()
    made = StageHost(job, secret, host="127.0.0.1").start()
    client = connect(made.address, secret, sender="test")
    yield made, client, secret
    client.close()
    made.close()


def join(client, name: str, token: str) -> dict:
    body = {"name": name, "stage": None, "instance": None, "pid": 7, "host": "h", "join_token": token}
    body.update(live_host=None, live_port=None)
    return client.call("stage_join", body, timeout_s=5.0).body


def beat(client, index: int, token: str, batch: int, records: list, status: dict | None = None) -> dict:
    body = {"index": index, "token": token, "batch": batch, "records": records, "status": status}
    return client.call("stage_beat", body, timeout_s=5.0).body


STATUS = {"step": 3, "loss": 1.5, "state": "training", "samples_per_s": 10.0}
METRIC = {
    "time_s": 1.0,
    "worker_id": "b",
    "step": 1,
    "loss": 2.0,
    "samples": 4,
    "epoch": 0,
    "membership_epoch": 1,
}


def test_join_gives_the_job_with_its_store_and_a_second_claim_is_refused(host):
    h, client, _ = host
    reply = join(client, "b", "tok")
    assert (
        reply["index"] == 1 and reply["job"]["store_port"] > 0 and reply["job"]["stage_names"] == ["a", "b"]
    )
    assert join(client, "b", "tok")["index"] == 1  # (the same join again)
    with pytest.raises(RemoteError, match="already claimed"):
        join(client, "b", "other")
    with pytest.raises(RemoteError, match="not a stage of this job"):
        join(client, "zz", "x")
    assert beat(client, 1, "tok", 1, [])["all_claimed"] is False
    join(client, "a", "tok-a")
    assert beat(client, 1, "tok", 2, [])["all_claimed"] is True


def test_reports_from_a_non_holder_or_out_of_schema_change_nothing(host, tmp_path):
    h, client, secret = host
    join(client, "a", "tok")
    with pytest.raises(RemoteError, match="not held by this worker"):
        beat(client, 0, "forged", 1, [METRIC], STATUS)
    with pytest.raises(RemoteError, match="not held by this worker"):
        client.call(
            "stage_failed", {"index": 0, "token": "forged", "cause": "own", "line": "x"}, timeout_s=5.0
        )
    with pytest.raises(CommError):  # (index out of its stated bounds: rejected before the handler)
        beat(client, 2**40, "tok", 1, [], None)
    intruder = connect(h.address, generate_secret(), sender="intruder")  # (another cluster's secret)
    with pytest.raises(CommError):
        body = {"name": "b", "stage": None, "instance": None, "pid": 1, "host": "h", "join_token": "t"}
        intruder.call("stage_join", {**body, "live_host": None, "live_port": None}, timeout_s=1.0)
    intruder.close()
    assert not (tmp_path / "run" / "stage0.status.json").exists()
    assert not (tmp_path / "run" / "stage0.failure.json").exists()
    assert read_jsonl(tmp_path / "report" / "metrics.jsonl", missing_ok=True) == []
    assert h.view().failures == {} and h.claims.missing() == [1]  # (b is still free)
    assert join(client, "b", "honest")["index"] == 1


def test_malformed_status_and_records_are_skipped_and_a_batch_counts_once(host, tmp_path):
    h, client, _ = host
    join(client, "a", "tok")
    bad = ["nope", 5, [1, 2], {**METRIC, "step": "x"}, {**METRIC, "loss": "high"}]
    beat(client, 0, "tok", 1, [*bad, METRIC], {"step": "x", "state": "training"})
    assert not (tmp_path / "run" / "stage0.status.json").exists()
    beat(client, 0, "tok", 1, [METRIC], STATUS)  # (batch 1 again: not ingested)
    (written,) = read_jsonl(tmp_path / "report" / "metrics.jsonl")
    assert written == {**METRIC, "worker_id": 0, "name": "a"}  # (the host's id and name for it)
    assert json.loads((tmp_path / "run" / "stage0.status.json").read_text()) == STATUS


def test_weights_arrive_whole_or_not_at_all(host, tmp_path):
    h, client, _ = host
    join(client, "a", "tok")
    data = bytes(range(256)) * 10
    chunks = [
        torch.frombuffer(bytearray(data[i : i + 1000]), dtype=torch.uint8) for i in range(0, len(data), 1000)
    ]
    send = lambda off, chunk: client.call(
        "stage_weights",
        {"index": 0, "token": "tok", "offset": off, "total": len(data)},
        [chunk],
        timeout_s=5.0,
    )
    send(0, chunks[0])
    with pytest.raises(RemoteError, match="does not continue the upload"):
        send(2000, chunks[2])  # (a chunk skipped)
    send(1000, chunks[1])
    result = {
        "index": 0,
        "token": "tok",
        "result": {"x": 1},
        "weights_sha256": hashlib.sha256(data).hexdigest(),
    }
    with pytest.raises(RemoteError, match="did not arrive whole"):
        client.call("stage_result", result, timeout_s=5.0)
    assert not (tmp_path / "run" / "stage0.safetensors").exists() and h.view().results == ()
    for i, chunk in enumerate(chunks):
        send(i * 1000, chunk)
    client.call("stage_result", result, timeout_s=5.0)
    assert (tmp_path / "run" / "stage0.safetensors").read_bytes() == data
    assert json.loads((tmp_path / "run" / "stage0.json").read_text()) == {"x": 1}
    assert h.view().results == (0,)


def test_a_stop_reaches_the_stages_in_their_next_beat_and_closes_the_door(host):
    h, client, _ = host
    join(client, "a", "tok")
    h.stop("stage b failed: boom")
    reply = beat(client, 0, "tok", 1, [])
    assert reply["stop"] is True and reply["why"] == "stage b failed: boom"
    with pytest.raises(RemoteError, match="the job is over: stage b failed: boom"):
        join(client, "b", "late")
    t = time.monotonic()
    assert h.beating_within(1.0) and time.monotonic() - t < 1.0


def test_a_released_process_goes_to_a_newcomer_who_learns_its_generation_in_a_beat(host):
    """A hosted instance coming back (``launch/pipeline_host_instances.py``): the process is freed
    while its old holder may still run -- its next beat hears why -- and the newcomer that takes
    it waits until its generation is decided (``admit``), which its beat then carries."""
    h, client, _ = host
    join(client, "a", "ta")
    join(client, "b", "old")
    assert beat(client, 1, "old", 1, [])["all_claimed"] is True
    h.release(1, None, "pipeline instance 0 lost: boom")
    reply = beat(client, 1, "old", 2, [])
    assert reply["stop"] is True and reply["why"] == "pipeline instance 0 lost: boom"
    assert h.view().missing == (1,)
    fresh = join(client, "b", "new")
    assert fresh["index"] == 1 and fresh["join"] == 0  # (not decided yet)
    reply = beat(client, 1, "new", 1, [])
    assert reply["all_claimed"] is False and reply["join"] == 0 and reply["stop"] is False
    h.admit([1], 3, arrival=4)
    reply = beat(client, 1, "new", 2, [])
    assert reply["all_claimed"] is True and reply["join"] == 3 and reply["stop"] is False
    assert reply["arrival"] == 4  # (its plan's serial: a hetpipe VW's worker id)
    assert join(client, "b", "new")["join"] == 3  # (a join sent again: the same claim, decided)
    assert beat(client, 1, "old", 3, [])["stop"] is True  # (the old holder stays out)
    with pytest.raises(RemoteError, match="not held by this worker"):
        body = {"index": 1, "token": "old", "result": {}, "weights_sha256": None}
        client.call("stage_result", body, timeout_s=5.0)
    assert beat(client, 0, "ta", 1, [])["all_claimed"] is True and h.view().results == ()


def test_a_newcomer_learns_its_generation_and_its_arrival_in_the_join_reply(host):
    """``flotilla run`` bringing an instance back (``launch/pipeline_attempt.spawn``): the process is
    released for generation ``join`` as the round's ``arrival``; a round tried again joins the same
    generation as a new arrival, and its newcomer is told the new one (a hetpipe VW's worker id)."""
    h, client, _ = host
    join(client, "a", "ta")
    join(client, "b", "old")
    assert join(client, "b", "old")["arrival"] == 0  # (one of the job's first)
    h.release(1, 3, arrival=1)
    assert join(client, "b", "first")["join"] == 3 and join(client, "b", "first")["arrival"] == 1
    h.release(1, 3, arrival=2)  # (that newcomer failed before it was in: tried again)
    fresh = join(client, "b", "second")
    assert fresh["join"] == 3 and fresh["arrival"] == 2


def test_a_stage_gives_a_silent_host_up_after_the_hosts_heartbeat_timeout(tmp_path):
    """A host that stops answering with its sockets open (a frozen or cut-off machine): the stage
    learns ``cluster.heartbeat_timeout_s`` from its join and stops after that silence plus one
    beat -- never before it, and not after a fixed 30 s."""
    job = StageJob(
        config={},
        store_host="",
        store_port=0,
        layer_ends=(2,),
        stage_names=("a",),
        speeds=(1.0,),
        total_steps=5,
        run_dir=tmp_path / "run",
        report_dir=tmp_path / "report",
    )
    (tmp_path / "run").mkdir()
    secret = generate_secret()
    h = StageHost(job, secret, host="127.0.0.1", heartbeat_timeout_s=1.5).start()
    link = StageLink(h.address, secret, sender="stage-a", interval_s=0.1)
    stopped: list[tuple[float, str]] = []
    gone = threading.Event()
    link.on_stop = lambda why: (stopped.append((time.monotonic(), why)), gone.set())
    try:
        assert link.join("a", None, None)[0] == 0 and link.orphan_after_s == pytest.approx(1.6)
        link.start()
        assert link.all_claimed.wait(10.0)  # (it beats, and the host answers)
        with h._lock:  # the host's handlers hang from here: every beat goes unanswered
            frozen = time.monotonic()
            assert gone.wait(30.0), "the stage never gave the silent host up"
        took = stopped[0][0] - frozen
        assert took >= 1.5 - 0.1, took  # (not before the host's own timeout, less one beat)
        assert "unreachable for 1.6 s" in stopped[0][1], stopped
        print(f"the stage gave the silent host up {took:.2f} s after it froze (timeout 1.5 s)")
    finally:
        link.on_stop = None
        link.close()
        h.close()


def test_lost_reports_are_sent_again_and_the_host_keeps_one_of_each(host, tmp_path, monkeypatch):
    """A stage's end over a lossy network (``comm/faulty.py``: half the weights chunks' and results'
    requests or replies lost, some duplicated): each report is sent again until answered, the
    host answers a repeat as the first (a chunk it has, a result it has), and what it keeps is
    the stage's weights byte for byte and its one result.  A different result from the same
    holder afterwards is refused."""
    h, client, secret = host
    monkeypatch.setattr(stage_link, "REPORT_TRY_S", 0.3)
    monkeypatch.setattr(stage_link, "BEAT_TRY_S", 0.3)
    monkeypatch.setattr(stage_link, "WEIGHTS_CHUNK_BYTES", 1000)
    ops = ("stage_weights", "stage_result", "stage_beat")
    faulty.install(NetFaults(drop=0.25, lose_reply=0.25, duplicate=0.25, ops=ops, seed=3))
    try:
        link = StageLink(h.address, secret, sender="stage-a")
    finally:
        faulty.install(None)
    try:
        assert link.join("a", None, None)[0] == 0
        weights = {"w": torch.arange(2000, dtype=torch.float32)}  # (8,000 bytes: 9 chunks with the header)
        link.result({"loss": 1.5}, weights)
        lost = link._client._faults.counts
        assert lost["drop"] + lost["lose_reply"] >= 2, lost  # (the seed loses some: they were sent again)
        data = (tmp_path / "run" / "stage0.safetensors").read_bytes()
        assert data == tensors_bytes(weights)
        assert json.loads((tmp_path / "run" / "stage0.json").read_text()) == {"loss": 1.5}
        assert h.view().results == (0,)
        for digest in (hashlib.sha256(data).hexdigest(), None):  # (the same weights, or none)
            body = {"index": 0, "token": link.token, "result": {"loss": 9.0}, "weights_sha256": digest}
            with pytest.raises(RemoteError, match="has reported its result"):
                client.call("stage_result", body, timeout_s=5.0)
        assert json.loads((tmp_path / "run" / "stage0.json").read_text()) == {"loss": 1.5}
    finally:
        link.close()


def test_a_weights_chunk_sent_again_changes_nothing_and_a_different_one_is_refused(host, tmp_path):
    h, client, _ = host
    join(client, "a", "tok")
    data = bytes(range(200)) * 10
    send = lambda off, raw: client.call(
        "stage_weights",
        {"index": 0, "token": "tok", "offset": off, "total": len(data)},
        [torch.frombuffer(bytearray(raw), dtype=torch.uint8)],
        timeout_s=5.0,
    )
    assert send(0, data[:1000]).body == {"received": 1000}
    assert send(0, data[:1000]).body == {"received": 1000}  # (offset 0 again: the upload starts over)
    assert send(1000, data[1000:]).body == {"received": 2000}
    assert send(1000, data[1000:]).body == {"received": 2000}  # (the last chunk again: kept once)
    with pytest.raises(RemoteError, match="does not continue the upload"):
        send(1000, bytes(1000))  # (other bytes at an offset it has)
    result = {"index": 0, "token": "tok", "result": {}, "weights_sha256": hashlib.sha256(data).hexdigest()}
    client.call("stage_result", result, timeout_s=5.0)
    client.call("stage_result", result, timeout_s=5.0)  # (sent again: answered as the first)
    assert (tmp_path / "run" / "stage0.safetensors").read_bytes() == data
