"""The coordinator role: rendezvous, membership views, metrics sink, job status.

It holds no training state that cannot be rebuilt (DESIGN §2): the model lives on the workers.
It hosts the rendezvous store of the collective plane and answers message-plane requests:

- ``join``      a worker (from the launcher or started by hand) gets a ``worker_id``, the run
                configuration and the store address;
- ``poll_view`` a worker's first poll (after its set-up) marks it *ready*: once ``min_workers``
                are ready the first view starts, later ready workers create a new view that
                survivors adopt at a step boundary; a waiting worker learns the newest *adopted*
                view that contains it;
- ``get_view``  a training worker fetches the view of the epoch all workers agreed on (through
                their vote all-reduce); the first such fetch marks that view adopted;
- ``leave``     a worker asked to leave (SIGTERM) is removed from the next view;
- ``heartbeat`` metrics records in, latest epoch and stop flag out; silent workers are removed;
                strategy ps: the records' clocks feed the clock spread (``clock_spread.py``:
                every worker's clock at the same instant, not each one's latest report);
- ``finish``    the final evaluation of the job; ``status`` a snapshot for progress displays.

Thread-safety: every handler runs on the message server's thread; ``snapshot``,
``remove_worker``, ``mark_left`` and ``settle_clocks``, called by the launcher, take the same lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flotilla.cluster.membership import View, merge_since, successor
from flotilla.comm.collective import StoreHost
from flotilla.comm.msgplane import Limits, serve
from flotilla.config import RunConfig
from flotilla.core.errors import RemoteError
from flotilla.core.log import get_logger
from flotilla.report.clock_spread import ClockSpread
from flotilla.report.metrics import EVALS_FILE, REQUIRED_EVAL_KEYS, MetricsWriter

log = get_logger("coordinator")

# heartbeats carry batches of metrics records in the msgpack header: allow 4 MiB headers on this
# control channel (workers cap a batch at MAX_RECORDS_PER_BEAT records, well below that)
COORDINATOR_LIMITS = Limits(max_message_bytes=16 * 2**20, max_header_bytes=4 * 2**20)


@dataclass(slots=True)
class WorkerInfo:
    worker_id: int
    name: str
    speed: float
    pid: int
    last_seen_s: float
    step: int = 0
    loss: float = float("nan")
    samples_per_s: float = 0.0
    membership_epoch: int = 0
    state: str = "joined"  # joined | ready | training | left | dead | done
    last_batch: int = -1  # heartbeat batch sequence number last ingested
    samples: int = 0
    busy_s: float = 0.0  # time spent in steps: sum of its records' interval_s (else step_s)
    clock: int | None = None  # strategy ps: the clock of its latest record


@dataclass(slots=True)
class JobState:
    views: dict[int, View] = field(default_factory=dict)
    latest_epoch: int = 0
    adopted_epoch: int = 0
    initial_epoch: int = -1
    stop: bool = False
    done: bool = False
    final: dict[str, Any] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)


class Coordinator:
    """Coordinator service; ``start()`` binds the store and the message server."""

    def __init__(
        self,
        cfg: RunConfig,
        secret: bytes,
        *,
        port: int = 0,
        report_dir: str | Path | None = None,
        ps_servers: list[str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.ps_servers = list(ps_servers or [])
        self._secret = secret
        self._port = port
        self._lock = threading.RLock()
        self._workers: dict[int, WorkerInfo] = {}
        self._job = JobState()
        self._t0_unix = time.time()
        self._last_expiry_check_s = time.monotonic()
        self._metrics = MetricsWriter(report_dir) if report_dir is not None else None
        self._evals = (
            MetricsWriter(report_dir, filename=EVALS_FILE, required=REQUIRED_EVAL_KEYS)
            if report_dir is not None
            else None
        )
        self._store: StoreHost | None = None
        self._server = None
        # strategy ps: the spread of the workers' clocks at common instants (clock_spread.py)
        self._clocks = ClockSpread() if cfg.strategy.kind == "ps" else None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Coordinator:
        host = self.cfg.cluster.host
        self._store = StoreHost(host, 0)
        self._server = serve(
            self._secret, f"tcp://{host}:{self._port}", name="coordinator", limits=COORDINATOR_LIMITS
        )
        for op, (fn, schema) in self._handlers().items():
            self._server.register(op, fn, schema)
        self._server.start()
        return self

    @property
    def address(self) -> str:
        return self._server.address

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._store is not None:
            self._store.close()
        if self._metrics is not None:
            self._metrics.close()
        if self._evals is not None:
            self._evals.close()

    def _handlers(self) -> dict:
        """op -> (handler, body schema); the message plane rejects bodies that do not match."""
        return {
            "join": (self._on_join, {"name": (str, None), "speed": (float, None), "pid": int}),
            "poll_view": (self._on_poll_view, {"worker_id": int, "after_epoch": int, "adopt": bool}),
            "get_view": (self._on_get_view, {"worker_id": int, "epoch": int}),
            "leave": (self._on_leave, {"worker_id": int}),
            "heartbeat": (self._on_heartbeat, {"worker_id": int, "batch": int, "records": list}),
            "finish": (self._on_finish, {"worker_id": int, "result": dict}),
            "status": (lambda req: self.snapshot(), {}),
            "describe": (lambda req: {"strategy": self.cfg.strategy.kind}, {}),
        }

    # ------------------------------------------------------------------ views
    def _new_view(self, members: tuple[int, ...]) -> View:
        prev = self._job.views.get(self._job.latest_epoch) or View(epoch=0, members=())
        view = successor(prev, members)
        self._job.views[view.epoch] = view
        self._job.latest_epoch = view.epoch
        log.info("view %d: members %s", view.epoch, view.members)
        return view

    def _current_members(self) -> tuple[int, ...]:
        view = self._job.views.get(self._job.latest_epoch)
        return view.members if view else ()

    def _change_members(self, add: int | None = None, drop: set[int] | None = None) -> None:
        members = set(self._current_members())
        if add is not None:
            members.add(add)
        members -= drop or set()
        if tuple(sorted(members)) != self._current_members():
            self._new_view(tuple(sorted(members)))

    # ------------------------------------------------------------------ handlers
    def _on_join(self, req) -> dict:
        """Register a worker.  It enters a view only once it is *ready* (its first ``poll_view``,
        sent after it has loaded data and built its model), so survivors never wait for a
        newcomer's set-up inside a rendezvous."""
        body = req.body
        with self._lock:
            if self._job.done or self._job.stop:
                raise RemoteError("job_over", "the job has finished; no more joins")
            wid = len(self._workers)
            name = str(body.get("name") or f"x{wid}")
            speed = self._speed_for(name, body.get("speed"))
            if not 0.0 < speed <= 1.0:
                raise RemoteError(
                    "bad_speed", f"speed must be in (0, 1] (relative to the fastest device), got {speed}"
                )
            self._workers[wid] = WorkerInfo(
                worker_id=wid,
                name=name,
                speed=speed,
                pid=int(body.get("pid", 0)),
                last_seen_s=time.monotonic(),
            )
            if self._clocks is not None:
                self._clocks.expect(wid)
            log.info("join: %s as worker %d (speed %.2f)", name, wid, speed)
            return {
                "worker_id": wid,
                "speed": speed,
                "config": self.cfg.to_dict(),
                "store_host": self._store.address.host,
                "store_port": self._store.address.port,
                "t0_unix": self._t0_unix,
                "ps_servers": self.ps_servers,
            }

    def _speed_for(self, name: str, requested: Any) -> float:
        if requested is not None:
            return float(requested)
        for spec in self.cfg.cluster.resolved_workers():
            if spec.name == name:
                return spec.speed
        return self.cfg.cluster.defaults.speed

    def _live(self) -> list[int]:
        return sorted(w for w, i in self._workers.items() if i.state in ("ready", "training"))

    def _mark_ready(self, wid: int) -> None:
        info = self._workers[wid]
        if info.state != "joined":
            return
        info.state = "ready"
        if self._job.adopted_epoch > 0:
            self._change_members(add=wid)
        elif len(self._live()) >= self.cfg.cluster.effective_min_workers():
            self._new_view(tuple(self._live()))
            self._job.adopted_epoch = self._job.latest_epoch
            self._job.initial_epoch = self._job.latest_epoch

    def _on_poll_view(self, req) -> dict:
        """A view newer than ``after_epoch`` containing the caller, once one is adopted.

        Recovering survivors (``adopt``) may adopt the newest view themselves: their old group is
        broken, so there is no vote to agree through.  If nothing changed in the membership (a
        timeout, not a death), a fresh view with the same members is made once per epoch so that
        every survivor has a new epoch to meet in.
        """
        wid, after = int(req.body["worker_id"]), int(req.body.get("after_epoch", 0))
        with self._lock:
            info = self._touch(wid)
            if self._job.done or self._job.stop:
                return {"status": "done"}
            if info.state in ("left", "dead"):
                return {"status": "removed"}
            self._mark_ready(wid)
            latest = self._job.views.get(self._job.latest_epoch)
            if req.body.get("adopt") and latest is not None and wid in latest.members:
                if latest.epoch == self._job.adopted_epoch <= after:
                    latest = self._new_view(latest.members)
                if latest.epoch > self._job.adopted_epoch and latest.epoch > after:
                    self._adopt(latest.epoch)
            view = self._job.views.get(self._job.adopted_epoch)
            if view is None or view.epoch <= after or wid not in view.members:
                return {"status": "wait"}
            return {
                "status": "view",
                "view": view.to_dict(),
                "initial": view.epoch == self._job.initial_epoch,
            }

    def _adopt(self, epoch: int) -> View:
        adopted = self._job.views.get(self._job.adopted_epoch) or View(epoch=0, members=())
        target = self._job.views[epoch]
        if epoch > self._job.adopted_epoch:
            self._job.views[epoch] = target = merge_since(adopted, target)
            self._job.adopted_epoch = epoch
            log.info(
                "view %d adopted: members %s joined %s left %s",
                epoch,
                target.members,
                target.joined,
                target.left,
            )
        return target

    def _on_get_view(self, req) -> dict:
        """The view of the epoch the workers agreed on (by their vote); marks it adopted."""
        epoch = int(req.body["epoch"])
        with self._lock:
            if epoch not in self._job.views:
                raise RemoteError("unknown_epoch", f"no view {epoch}; latest is {self._job.latest_epoch}")
            if epoch < self._job.adopted_epoch:  # superseded: meet in the adopted view instead
                epoch = self._job.adopted_epoch
            return {"view": self._adopt(epoch).to_dict()}

    def _on_leave(self, req) -> dict:
        wid = int(req.body["worker_id"])
        with self._lock:
            if wid in self._workers:
                self._workers[wid].state = "left"
                self._close_clock(wid, keep=True)
            self._change_members(drop={wid})
            return {"epoch": self._job.latest_epoch}

    def _on_heartbeat(self, req) -> dict:
        body = req.body
        wid = int(body["worker_id"])
        with self._lock:
            info = self._touch(wid)
            batch = int(body.get("batch", -1))
            if batch > info.last_batch:  # a re-sent batch (lost reply) is not ingested twice
                info.last_batch = batch
                for rec in body.get("records", ()):
                    try:
                        self._ingest(info, rec)
                    except (TypeError, ValueError, ArithmeticError, AttributeError, OSError) as exc:
                        log.warning("worker %d: metrics record dropped (%s)", wid, exc)
            self._expire_silent()
            return {"epoch": self._job.latest_epoch, "stop": self._job.stop or self._job.done}

    def _on_finish(self, req) -> dict:
        with self._lock:
            self._job.final = dict(req.body.get("result", {}))
            self._job.done = True
            for info in self._workers.values():
                if info.state == "training":
                    info.state = "done"
            return {"ok": True}

    # ------------------------------------------------------------------ bookkeeping
    def _touch(self, wid: int) -> WorkerInfo:
        info = self._workers.get(wid)
        if info is None:
            raise RemoteError("unknown_worker", f"worker {wid} never joined")
        info.last_seen_s = time.monotonic()
        return info

    def _ingest(self, info: WorkerInfo, rec: dict) -> None:
        if rec.get("kind") == "eval":
            self._job.evals.append(dict(rec))
            if self._evals is not None:
                try:
                    self._evals.write(dict(rec, worker_id=info.worker_id, name=info.name))
                except ValueError as exc:  # a malformed record is not fatal
                    log.warning("eval record from worker %d not written: %s", info.worker_id, exc)
            return
        # everything is checked and converted before anything changes: a bad record is
        # dropped whole (the caller logs it)
        line = (
            self._metrics.encode(dict(rec, worker_id=info.worker_id, name=info.name))
            if self._metrics is not None
            else None
        )
        step, loss = int(rec.get("step", info.step)), float(rec.get("loss", info.loss))
        rate = float(rec.get("samples_per_s", info.samples_per_s))
        membership_epoch = int(rec.get("membership_epoch", info.membership_epoch))
        samples = int(rec.get("samples", 0))
        # time in steps since the previous record (records may be every Nth step)
        busy_s = float(rec.get("interval_s", rec.get("step_s", 0.0)))
        if self._clocks is not None and "clock" in rec:
            if self._clocks.add(info.worker_id, rec.get("time_s"), rec["clock"]):
                info.clock = rec["clock"]
        info.step, info.loss, info.samples_per_s = step, loss, rate
        info.membership_epoch = membership_epoch
        info.samples += samples
        info.busy_s += busy_s
        if info.state in ("joined", "ready"):
            info.state = "training"
        if line is not None:
            self._metrics.append(line)

    def _expire_silent(self) -> None:
        limit = self.cfg.cluster.heartbeat_timeout_s
        now = time.monotonic()
        stalled = now - self._last_expiry_check_s > limit / 2
        self._last_expiry_check_s = now
        if stalled:  # this process itself was not running (e.g. suspended): nobody is to blame
            for i in self._workers.values():
                i.last_seen_s = now
            return
        dead = {
            w
            for w, i in self._workers.items()
            if i.state in ("joined", "ready", "training") and now - i.last_seen_s > limit
        }
        for w in dead:
            self._mark_dead(w, f"no heartbeat for {limit:.0f} s")

    def _mark_dead(self, wid: int, why: str) -> None:
        info = self._workers[wid]
        if info.state in ("left", "dead", "done"):
            return
        info.state = "dead"
        self._close_clock(wid, keep=False)
        log.warning("worker %d (%s) declared dead: %s", wid, info.name, why)
        if self._job.adopted_epoch > 0:
            self._change_members(drop={wid})

    def _close_clock(self, wid: int, *, keep: bool) -> None:
        if self._clocks is not None:
            self._clocks.close(wid, keep=keep)

    # ------------------------------------------------------------------ launcher API
    def remove_worker(self, name: str, why: str) -> None:
        """The launcher saw the process of ``name`` die unexpectedly."""
        with self._lock:
            for wid, info in self._workers.items():
                if info.name == name:
                    if info.state in ("left", "done"):  # it had finished: its clocks count
                        self._close_clock(wid, keep=True)
                    self._mark_dead(wid, why)

    def mark_left(self, name: str) -> None:
        """The launcher saw the process of ``name`` exit normally (its records are all in)."""
        with self._lock:
            for wid, info in self._workers.items():
                if info.name != name:
                    continue
                self._close_clock(wid, keep=True)
                if info.state in ("joined", "ready", "training"):
                    info.state = "left"
                    self._change_members(drop={wid})

    def settle_clocks(self) -> None:
        """No more records will come (the job is over and its workers exited, or the launcher
        stopped waiting for them): sweep every clock record in, for the summary."""
        with self._lock:
            for wid in self._workers:
                self._close_clock(wid, keep=True)

    def request_stop(self) -> None:
        with self._lock:
            self._job.stop = True

    def snapshot(self) -> dict:
        with self._lock:
            view = self._job.views.get(self._job.adopted_epoch)
            return {
                "epoch": self._job.adopted_epoch,
                "latest_epoch": self._job.latest_epoch,
                "members": list(view.members) if view else [],
                "done": self._job.done,
                "stop": self._job.stop,
                "final": dict(self._job.final),
                "evals": list(self._job.evals),
                "elapsed_s": time.time() - self._t0_unix,
                "strategy": self.cfg.strategy.kind,
                "workers": [
                    {
                        "worker_id": i.worker_id,
                        "name": i.name,
                        "speed": i.speed,
                        "step": i.step,
                        "loss": i.loss,
                        "samples_per_s": i.samples_per_s,
                        "state": i.state,
                        "membership_epoch": i.membership_epoch,
                        "samples": i.samples,
                        "busy_s": i.busy_s,
                        "clock": i.clock,
                    }
                    for i in self._workers.values()
                ],
                "clock_spread": None if self._clocks is None else self._clocks.spread,
                "max_clock_spread": None if self._clocks is None else self._clocks.max_spread,
            }
