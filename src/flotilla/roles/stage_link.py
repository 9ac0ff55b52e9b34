"""A stage worker's link to its pipeline's host (``roles/stage_host.py``): its join, its beats,
and the stage's reports (it is the stage's ``StageOutput``, ``roles/stage_output.py``).

- :meth:`StageLink.join` names the stage process this worker runs (its name, or a stage index and
  pipeline instance); the host's refusal (an unknown name or index, a process another worker
  holds) is a ConfigError with the host's one line.  A join that gets no answer is sent again with
  the same token for up to ``JOIN_WAIT_S`` (the host answers a repeated token with the same claim).
- A beat thread sends, every ``interval_s``, the stage's newest status and its queued records
  (a step's record, an evaluation's: ``metrics.jsonl``/``evals.jsonl``; a batch not acknowledged
  is sent again as is, with its number: the host ingests it once).  :meth:`StageLink.await_all`
  waits until every stage process of the job has joined (a stage's groups form only then).  When
  a beat's answer says the job is over for this stage (another stage failed), or the host stays
  unreachable for ``orphan_after_s`` -- from the join on, the host's ``cluster.heartbeat_timeout_s``
  (sent in its join reply) plus one beat: the stage gives the host up after the silence after
  which the host gives a stage up -- ``on_stop`` is called from the beat thread with the reason.
- At its end the stage sends its weights (safetensors bytes, in chunks of
  ``WEIGHTS_CHUNK_BYTES``, with their SHA-256) and its result; a failed stage says why.  Each of
  these requests, and a beat's batch, is sent again when its answer does not come (a lost
  request or reply): the host answers a chunk, a result or a failure it already has as it did
  the first time (``roles/stage_host.py``), so a lost message costs one try's wait, not the stage.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from flotilla.comm.addresses import local_toward, split_host_port
from flotilla.comm.liveness import LivenessListener
from flotilla.comm.msgplane import connect
from flotilla.core.errors import CallTimeout, CommError, ConfigError, RemoteError
from flotilla.core.log import get_logger
from flotilla.elastic.checkpoint import tensors_bytes
from flotilla.roles.link import RecordBatches
from flotilla.roles.stage_host_protocol import HOST_LIMITS, WEIGHTS_CHUNK_BYTES

__all__ = ["JOIN_WAIT_S", "StageLink"]

log = get_logger("stage-link")

JOIN_TRY_S = 5.0
JOIN_WAIT_S = 60.0
# the end's reports: one try's wait for the answer (a weights chunk's: also one second per
# REPORT_BYTES_PER_S bytes it carries, so a slow link's big chunk is not sent again while it is
# still arriving), and how long they are sent again
REPORT_TRY_S, REPORT_WAIT_S, REPORT_BYTES_PER_S = 5.0, 120.0, 5e6
FAILED_TRY_S, FAILED_WAIT_S = 1.0, 5.0  # (a failing stage's last word: best effort)
BEAT_TRY_S = 2.0  # a flush's try (its batch is sent again, as is, until patience runs out)
ALL_JOINED_LOG_S = 10.0  # while waiting for the other stages: a line this often


class StageLink:
    """One stage worker's link to the pipeline's host (module doc)."""

    def __init__(
        self,
        address: str,
        secret: bytes,
        *,
        sender: str,
        interval_s: float = 0.25,
        orphan_after_s: float = 10.0,
    ) -> None:
        self.address = address
        # (its death closes this listener's connection from the host: seen at once, comm/liveness.py)
        self._live_host = local_toward(split_host_port(address.removeprefix("tcp://"))[0])
        self._listener = LivenessListener(self._live_host)
        self._client = connect(address, secret, sender=sender, limits=HOST_LIMITS)
        self._beat_client = connect(address, secret, sender=sender + "/beat", limits=HOST_LIMITS)
        self.interval_s, self.orphan_after_s = interval_s, orphan_after_s
        self.token = secrets.token_hex(16)
        self.index = -1
        self._send_lock = threading.Lock()
        self._batches = RecordBatches()
        self._status: dict[str, Any] | None = None  # the newest, sent with every beat
        self.all_claimed = threading.Event()
        self.claimed = 0
        self.generation = 0  # the generation this newcomer joins, when the host decides it after the join
        self.arrival = 0  # a newcomer's round, as the host told it (launch/pipeline_instances.Spawn)
        self.stop_why = ""
        self.on_stop: Callable[[str], None] | None = None
        self._stop_evt = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------ join
    def join(
        self, name: str | None, stage: int | None, instance: int | None
    ) -> tuple[int, dict[str, Any], int]:
        """This worker's stage process, the job, and the generation a newcomer of a pipeline
        instance coming back joins (0: none) (module doc)."""
        body = {
            "name": name,
            "stage": stage,
            "instance": instance,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "join_token": self.token,
            "live_host": self._live_host,
            "live_port": self._listener.port,
        }
        try:
            reply = self._report("stage_join", body, [], JOIN_TRY_S, JOIN_WAIT_S)
        except RemoteError as exc:
            if exc.code == "refused":
                raise ConfigError(str(exc.message)) from None
            raise
        self.index = int(reply["index"])
        arrival = reply.get("arrival")
        self.arrival = arrival if type(arrival) is int and arrival > 0 else 0
        timeout_s = reply.get("heartbeat_timeout_s")
        if isinstance(timeout_s, (int, float)) and 0 < timeout_s <= 3600:  # (the config's bounds)
            self.orphan_after_s = float(timeout_s) + self.interval_s
        return self.index, dict(reply["job"]), int(reply.get("join") or 0)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="stage-beat", daemon=True)
        self._thread.start()

    def await_all(self, describe: str) -> None:
        """Until every stage process of the job has joined (the host says so in its beats); a
        newcomer of an instance coming back: until its instance's have and its generation is
        decided (:attr:`generation`)."""
        said = time.monotonic()
        while not self.all_claimed.wait(0.2):
            if self.stop_why:
                raise CommError(f"the job ended before every stage joined: {self.stop_why}")
            if time.monotonic() - said >= ALL_JOINED_LOG_S:
                log.info("%s: waiting for the other stages to join (%d joined)", describe, self.claimed)
                said = time.monotonic()

    # ------------------------------------------------------------------ StageOutput
    def status(self, st: dict[str, Any]) -> None:
        self._status = dict(st)  # (one reference swapped: the beat thread reads the newest)

    def metric(self, rec: dict[str, Any]) -> None:
        self._batches.add(rec)

    def evaluation(self, rec: dict[str, Any]) -> None:
        self._batches.add(rec)

    def result(self, out: dict[str, Any], weights: dict[str, torch.Tensor] | None) -> None:
        """Records first (the host finishes once every result is in), then weights and result."""
        self.flush()
        digest = None
        if weights is not None:
            data = tensors_bytes(weights)
            digest = hashlib.sha256(data).hexdigest()
            whole = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            for offset in range(0, len(data), WEIGHTS_CHUNK_BYTES):
                chunk = whole[offset : offset + WEIGHTS_CHUNK_BYTES]
                body = {"index": self.index, "token": self.token, "offset": offset, "total": len(data)}
                try_s = REPORT_TRY_S + chunk.numel() / REPORT_BYTES_PER_S
                self._report("stage_weights", body, [chunk], try_s, REPORT_WAIT_S)
        body = {"index": self.index, "token": self.token, "result": out, "weights_sha256": digest}
        self._report("stage_result", body, [], REPORT_TRY_S, REPORT_WAIT_S)

    def failure(self, cause: str, line: str) -> None:
        if self.index < 0:
            return
        try:
            body = {"index": self.index, "token": self.token, "cause": cause, "line": line}
            self._report("stage_failed", body, [], FAILED_TRY_S, FAILED_WAIT_S)
        except CommError as exc:
            log.warning("could not tell the host why this stage failed: %s", exc)

    def _report(
        self, op: str, body: dict[str, Any], tensors: list[torch.Tensor], try_s: float, wait_s: float
    ) -> dict[str, Any]:
        """``op`` sent until it is answered, its answer (a try unanswered in ``try_s`` is sent again,
        for up to ``wait_s``; the host answers a repeat as it did the first: module doc)."""
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            try:
                return dict(self._client.call(op, body, tensors, timeout_s=max(0.1, min(try_s, left))).body)
            except CallTimeout as exc:
                if time.monotonic() >= deadline:
                    raise
                log.warning("%s was not answered (%s): sending it again", op, exc)

    def close(self) -> None:
        """The final status and records sent, the connections closed (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop_evt.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        try:
            if self.index >= 0:
                self.flush(patience_s=5.0)  # (the final status and records)
        except CommError as exc:
            log.warning("the last records did not reach the host: %s", exc)
        self._client.close()
        self._beat_client.close()
        self._listener.close()  # (with a goodbye: this stage ended on purpose)

    # ------------------------------------------------------------------ beats
    def flush(self, patience_s: float = 30.0) -> None:
        """Send what is queued now; a batch not acknowledged is sent again for up to ``patience_s``."""
        deadline = time.monotonic() + patience_s
        while True:
            try:
                self._send_once(timeout_s=max(0.1, min(BEAT_TRY_S, deadline - time.monotonic())))
                return
            except CallTimeout:
                if time.monotonic() >= deadline:
                    raise

    def _send_once(self, timeout_s: float) -> None:
        with self._send_lock:
            batch, records = self._batches.batch()  # (an unacknowledged one is re-sent as is)
            body = {
                "index": self.index,
                "token": self.token,
                "batch": batch,
                "records": records,
                "status": self._status,  # (the newest: a status is never out of date when sent)
            }
            reply = self._beat_client.call("stage_beat", body, timeout_s=timeout_s).body
            self._batches.acked()
        self.claimed = int(reply.get("claimed", 0))
        join = reply.get("join")
        if type(join) is int and join > 0:  # (a newcomer's generation, decided once its instance is in)
            arrival = reply.get("arrival")
            self.arrival = arrival if type(arrival) is int and arrival > 0 else 0
            self.generation = join
        if reply.get("all_claimed"):
            self.all_claimed.set()
        if reply.get("stop") and not self.stop_why:
            self.stop_why = str(reply.get("why") or "the host stopped the job")[:2000]
            if self.on_stop is not None:
                self.on_stop(self.stop_why)

    def _beat(self) -> None:
        last_ok = time.monotonic()
        while not self._stop_evt.wait(self.interval_s):
            try:
                # (1-s tries: ten in the host's heartbeat timeout, so a few lost beats or replies in a
                # row do not add up to the silence after which this stage gives the host up)
                self._send_once(timeout_s=max(1.0, self.interval_s * 4))
                last_ok = time.monotonic()
            except RemoteError as exc:
                log.error("the host refused this stage's beat: %s", exc)
                self._give_up(f"the host refused this stage's beat: {exc}")
                return
            except CommError as exc:
                if time.monotonic() - last_ok > self.orphan_after_s:
                    gone = f"{self.orphan_after_s:g} s ({exc})"
                    self._give_up(f"the pipeline's host at {self.address} unreachable for {gone}")
                    return

    def _give_up(self, why: str) -> None:
        self.stop_why = why
        if self.on_stop is not None:
            self.on_stop(why)
