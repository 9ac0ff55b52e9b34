"""The host of a pipeline job whose stages join it: ``flotilla coordinator`` for ``kind: pipeline``.

Stage workers started on any host (``flotilla worker --coordinator HOST:PORT``: by hand, or by a
scheduler) join it as replicas join the coordinator of a data-parallel job.  It hosts the job's
authenticated rendezvous store on ``cluster.host`` (every stage group and replica group forms
there) and answers, on the message plane (every frame signed with the cluster secret):

- ``describe``     ``{"strategy": "pipeline"}``: a ``flotilla worker`` learns it runs a stage;
- ``stage_join``   a worker names the stage process it runs (its name, or ``stage``/``instance``;
                   ``pipeline/stage_claims.py`` decides and refuses, in one line, an unknown name,
                   a stage or instance out of range, a process another worker holds); it gets the
                   typed job (``StageJob``, the store's address filled in), its process index and
                   ``join``: the generation a newcomer of a pipeline instance coming back joins
                   (0: none or not decided yet; the launcher that started it said so with
                   :meth:`StageHost.release`, or decides it once every stage of the instance
                   has joined, :meth:`StageHost.admit`) and ``heartbeat_timeout_s``
                   (``cluster.heartbeat_timeout_s``: the silence after which the stage gives
                   this host up, as the host gives up a silent stage);
- ``stage_beat``   every half second: the stage's progress (``status``) and its queued records
                   (through the coordinator's metrics sink, ``roles/metrics_sink.py``: the same
                   ``metrics.jsonl``/``evals.jsonl`` records as a replica's, with its id and name,
                   and the configured trackers; each batch ingested once by its number);
                   out: how many stages have joined, whether all it waits for have
                   (``all_claimed``: every stage process; for a newcomer, its generation decided),
                   ``join`` (a newcomer's generation, once decided), and ``stop`` with the job's
                   error line when the job is over for it (a worker whose process was given to
                   a newcomer hears why its instance was lost);
- ``stage_weights`` / ``stage_result``  at its end: its weights (the lead instance's, as
                   safetensors bytes in chunks, checked against their SHA-256) and its result;
- ``stage_failed`` why it failed (``own``, or ``group``: its stage group broke under it).

A stage's join names its liveness listener (``comm/liveness.py``); the host holds a connection to
it, so a stage whose process dies is known at once (:attr:`HostView.dead`), one that ends on
purpose says goodbye first.

It writes what the stages report into its run directory (``stage<G>.status.json``,
``stage<G>.json``, ``stage<G>.safetensors``, ``stage<G>.failure.json``), and their records into
the report directory.  ``flotilla run`` hosts its stages the same way (``launch/pipeline_attempt.py``:
one host per attempt, its stages started on this machine), so there is one path for stages here
and stages anywhere.  A request
from a worker that does not hold the process it names, or a malformed report, is refused and
logged and changes nothing.

Thread-safety: the handlers run on the message server's thread; the launcher's calls
(:meth:`StageHost.view`, :meth:`StageHost.stop`) take the same lock.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from flotilla.comm.liveness import LivenessWatch
from flotilla.comm.msgplane import serve
from flotilla.comm.store import StoreAddress, StoreHost
from flotilla.config import ReportConfig
from flotilla.core.atomic_io import atomic_write_json
from flotilla.core.errors import RemoteError
from flotilla.core.log import get_logger
from flotilla.pipeline.stage_claims import ClaimRefused, StageClaims
from flotilla.report.trackers import config_text, make_tracker
from flotilla.roles.metrics_sink import MetricsSink, WorkerInfo
from flotilla.roles.stage_host_protocol import (
    BODIES,
    FAILURE_CAUSES,
    HOST_LIMITS,
    HostView,
    status_fields,
)
from flotilla.roles.stage_reports import StageReports
from flotilla.trainer.pipeline_job import StageJob

__all__ = ["HostView", "StageHost"]

log = get_logger("pipeline-host")


class StageHost:
    """The pipeline job's host (module doc); ``start()`` binds the store and the message server."""

    def __init__(
        self,
        job: StageJob,
        secret: bytes,
        *,
        host: str,
        port: int = 0,
        heartbeat_timeout_s: float = 10.0,
        store_timeout_s: float = 60.0,
        report: ReportConfig | None = None,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job, self.secret, self.host, self.port = job, secret, host, port
        self.heartbeat_timeout_s, self.store_timeout_s, self._now = heartbeat_timeout_s, store_timeout_s, now
        self.claims = StageClaims(job.stage_names, job.layout)
        self._lock = threading.Lock()
        self._infos: dict[int, WorkerInfo] = {}  # process -> what the metrics sink knows of it
        self._joins: dict[int, int | None] = {}  # process -> the generation its newcomer joins (None: later)
        self._arrivals: dict[int, int] = {}  # process -> its newcomer's arrival (launch/pipeline_instances)
        self._retired: dict[str, str] = {}  # token of a holder whose process was released -> why
        self._reports = StageReports(job.run_dir)  # (weights and results: roles/stage_reports.py)
        self._failures: dict[int, tuple[str, str]] = {}
        self._stop_why: str | None = None
        self._stopped: dict[int, str] = {}  # process -> why the job is over for it (its instance lost)
        self._dead: set[int] = set()  # processes whose liveness connection ended without a goodbye
        self._watched: dict[int, tuple[str, int]] = {}
        self._live = LivenessWatch(self._closed, name="pipeline-host")
        self._t0_unix = time.time()
        tracker = None
        if report is not None:  # (report/trackers.py: TensorBoard, MLflow)
            tracker = make_tracker(
                report.trackers,
                job.report_dir,
                mlflow_uri=report.mlflow_uri,
                mlflow_experiment=report.mlflow_experiment,
            )
            if tracker is not None:
                tracker.text("config", config_text(job.config), 0)
                tracker.params(job.config)
        self.sink = MetricsSink(job.report_dir, clock_spread=False, tracker=tracker)
        self._store: StoreHost | None = None
        self._server: Any = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> StageHost:
        self._store = StoreHost(self.host, 0, timeout_s=self.store_timeout_s)
        self.job = replace(self.job, store_host=self._store.address.host, store_port=self._store.address.port)
        self._server = serve(
            self.secret, f"tcp://{self.host}:{self.port}", name="pipeline-host", limits=HOST_LIMITS
        )
        handlers = {
            "stage_join": self._on_join,
            "stage_beat": self._on_beat,
            "stage_weights": self._on_weights,
            "stage_result": self._on_result,
            "stage_failed": self._on_failed,
        }
        for op, fn in handlers.items():
            self._server.register(op, fn, BODIES[op], max_tensors=1 if op == "stage_weights" else 0)
        self._server.register("describe", lambda req: {"strategy": "pipeline", "role": "stage"}, {})
        self._server.start()
        return self

    @property
    def address(self) -> str:
        return str(self._server.address)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._store is not None:
            self._store.close()
        self._live.close()
        self.sink.close()

    # ------------------------------------------------------------------ the launcher's side
    def view(self, quiet_s: float = math.inf) -> HostView:
        with self._lock:
            ended = [*self._reports.results, *self._failures]
            silent = self.claims.silent(self._now(), self.heartbeat_timeout_s, done=ended)
            dead = sorted(g for g in self._dead if g not in ended and g not in self._stopped)
            quiet = self.claims.silent(self._now(), quiet_s, done=ended) if quiet_s < math.inf else []
            return HostView(
                claimed=tuple(sorted(self.claims.claims)),
                missing=tuple(self.claims.missing()),
                results=tuple(sorted(self._reports.results)),
                failures=dict(self._failures),
                silent=tuple(silent),
                dead=tuple(dead),
                quiet=tuple(sorted(quiet, key=lambda g: self.claims.last_beat[g])),
            )

    def stop(self, why: str) -> None:
        """The job is over for every stage still running: their next beat says so (``why``)."""
        with self._lock:
            if self._stop_why is None:
                self._stop_why = why

    def stop_processes(self, indices: list[int], why: str) -> None:
        """The job is over for these stage processes (their pipeline instance was lost): their
        next beat says so."""
        with self._lock:
            for g in indices:
                self._stopped.setdefault(g, why)

    def describe(self, index: int) -> str:
        return self.claims.describe(index)

    @property
    def store_address(self) -> StoreAddress:
        assert self._store is not None, "start() first"
        return self._store.address

    def release(self, index: int, join: int | None = 0, why: str = "", *, arrival: int = 0) -> None:
        """Stage process ``index``'s holder is gone (or told to go: ``why``, its beats hear it) and
        a newcomer may take it, which joins generation ``join`` (``pipeline/replicas.py``; None:
        decided later, :meth:`admit`) as ``arrival`` (the launcher's serial of its round, told to
        the strategy: ``launch/pipeline_instances.Spawn``); its old result and failure forgotten."""
        with self._lock:
            held = self.claims.claims.get(index)
            if held is not None:
                gone = why or self._stopped.get(index) or "its stage process was given to a newcomer"
                self._retired[held.token] = gone
            self.claims.release(index)
            self._joins[index] = join
            self._arrivals[index] = arrival
            self._infos.pop(index, None)
            self._failures.pop(index, None)
            self._reports.forget(index)
            self._dead.discard(index)
            self._stopped.pop(index, None)
            if self._watched.pop(index, None) is not None:
                self._live.watch(self._watched)

    def reformed(self, job: StageJob, retired: list[int], why: str) -> None:
        """An instance formed again on new stage processes (``StageJob.reformed``): the job a
        newcomer receives from now on; ``retired``, its old processes, given up (``why``)."""
        with self._lock:
            self.claims.extend(job.stage_names, job.layout)
            self.job = replace(job, store_host=self.job.store_host, store_port=self.job.store_port)
        for g in retired:
            self.release(g, why=why)

    def admit(self, indices: list[int], join: int, *, arrival: int = 0) -> None:
        """The newcomers holding ``indices`` join generation ``join`` as ``arrival`` (their beats
        say so; :meth:`release`)."""
        with self._lock:
            for g in indices:
                self._joins[g] = join
                self._arrivals[g] = arrival

    def mark_silent(self, index: int) -> str:
        """Stage process ``index`` went silent (frozen, hung) and its launcher kills it: its failure
        is that, in the stage's own name (``stage<G>.failure.json``); the line."""
        line = (
            f"silent for more than {self.heartbeat_timeout_s:g} s (cluster.heartbeat_timeout_s: "
            "frozen or hung), killed"
        )
        with self._lock:
            self._failures.setdefault(index, ("own", line))
            atomic_write_json(self.job.run_dir / f"stage{index}.failure.json", {"cause": "own", "line": line})
        return line

    def beating_within(self, window_s: float) -> bool:
        """Whether a stage beat in the last ``window_s`` (a stage gone quiet has heard a stop)."""
        with self._lock:
            now = self._now()
            return any(now - t <= window_s for t in self.claims.last_beat.values())

    # ------------------------------------------------------------------ handlers
    def _closed(self, index: int, graceful: bool) -> None:
        """A stage's liveness connection ended (on the watch's thread): without a goodbye, its
        process is gone (``comm/liveness.py``)."""
        if graceful:
            return
        with self._lock:
            if index in self._watched:
                self._dead.add(index)
                log.warning(
                    "%s: its process is gone (its liveness connection closed)", self.claims.describe(index)
                )

    def _holder(self, body: dict[str, Any]) -> int:
        index = int(body["index"])
        if index >= len(self.job.stage_names) or not self.claims.holds(index, str(body["token"])):
            raise RemoteError("not_holder", f"stage process {index} is not held by this worker")
        return index

    def _on_join(self, req: Any) -> dict[str, Any]:
        b = req.body
        with self._lock:
            try:
                index = self.claims.place_of(b.get("name"), b.get("stage"), b.get("instance"))
                if self._stop_why is not None:
                    raise ClaimRefused(f"the job is over: {self._stop_why}")
                claim = self.claims.claim(
                    index, str(b["join_token"]), int(b["pid"]), str(b["host"])[:256], self._now()
                )
            except ClaimRefused as exc:
                log.warning("stage join refused (%s): %s", req.sender, exc)
                raise RemoteError("refused", str(exc)) from None
            if index not in self._infos:
                log.info("%s joined: pid %d on %s", self.claims.describe(index), claim.pid, claim.host)
                name, speed = self.job.stage_names[index], float(self.job.speeds[index])
                self._infos[index] = WorkerInfo(worker_id=index, name=name, speed=speed, pid=claim.pid)
            if b.get("live_host") and b.get("live_port") and index not in self._watched:
                self._watched[index] = (str(b["live_host"])[:256], int(b["live_port"]))
                self._live.watch(self._watched)
            join = self._joins.get(index) or 0
            return {
                "index": index,
                "job": self.job.to_dict(),
                "t0_unix": self._t0_unix,
                "join": join,
                "arrival": self._arrivals.get(index, 0),
                # (the stage gives the host up after the same silence: roles/stage_link.py)
                "heartbeat_timeout_s": self.heartbeat_timeout_s,
            }

    def _on_beat(self, req: Any) -> dict[str, Any]:
        b = req.body
        with self._lock:
            retired = self._retired.get(str(b["token"]))
            if retired is not None:  # (its process was released: the newcomer's now)
                claimed = len(self.claims.claims)
                return {"claimed": claimed, "all_claimed": False, "stop": True, "why": retired}
            index = self._holder(b)
            self.claims.beat(index, str(b["token"]), self._now())
            if b.get("status") is not None:
                self._write_status(index, b["status"])
            trained = self.sink.ingest_batch(self._infos[index], int(b["batch"]), b["records"])
            if trained and self.sink.tracker is not None:  # (the steps every last stage passed)
                self.sink.flush_steps(self._slowest_last_stage())
            why = self._stop_why if self._stop_why is not None else self._stopped.get(index)
            return {
                "claimed": len(self.claims.claims),
                "all_claimed": self._all_in(index),
                "join": self._joins.get(index) or 0,
                "arrival": self._arrivals.get(index, 0),
                "stop": why is not None,
                "why": why or "",
            }

    def _all_in(self, index: int) -> bool:
        """Whether what ``index``'s holder waits for before it starts is there: every stage process
        claimed; for a newcomer (:meth:`release`), its instance's processes claimed and the
        generation it joins decided."""
        if index not in self._joins or self._joins[index] == 0:
            return self.claims.all_claimed()
        layout = self.job.layout
        mates = layout.processes(layout.instance_of(index))
        return self._joins[index] is not None and all(g in self.claims.claims for g in mates)

    def _slowest_last_stage(self) -> int:
        """The step every last stage that holds its process has passed (only they hold losses)."""
        layout = self.job.layout
        last = {layout.processes(r)[-1] for r in range(layout.num_instances)}
        steps = [i.step for g, i in self._infos.items() if g in last and g not in self._failures]
        return min(steps) if steps else 0

    def _write_status(self, index: int, st: Any) -> None:
        kept = status_fields(st)
        if kept is None:
            log.warning("%s: malformed status ignored: %.200r", self.claims.describe(index), st)
            return
        atomic_write_json(self.job.run_dir / f"stage{index}.status.json", kept)

    def _on_weights(self, req: Any) -> dict[str, Any]:
        with self._lock:
            return self._reports.weights(self._holder(req.body), req.body, req.tensors)

    def _on_result(self, req: Any) -> dict[str, Any]:
        with self._lock:
            return self._reports.result(self._holder(req.body), req.body)

    def _on_failed(self, req: Any) -> dict[str, Any]:
        b = req.body
        with self._lock:
            index = self._holder(b)
            cause = str(b["cause"]) if b["cause"] in FAILURE_CAUSES else "own"
            line = str(b["line"])[:2000]
            self._failures.setdefault(index, (cause, line))
            atomic_write_json(self.job.run_dir / f"stage{index}.failure.json", {"cause": cause, "line": line})
            # (a stage that stopped because its group broke follows another's failure: a warning)
            level = logging.WARNING if cause == "group" else logging.ERROR
            log.log(level, "%s failed (%s): %s", self.claims.describe(index), cause, line)
            return {"ok": True}
