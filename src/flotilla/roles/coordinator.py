"""The coordinator role: rendezvous, membership views, metrics sink, job status.

It holds no training state that cannot be rebuilt (DESIGN §2): the model lives on the workers.
It hosts the rendezvous store of the collective plane and answers message-plane requests.  Every
membership decision is the pure state machine's (``cluster/rendezvous.py``: who is in which view,
when a broken epoch is replaced, who is dead); these handlers turn messages into its events and
its replies into messages, and keep the metrics (``metrics_sink.py``):

- ``join``      a worker (from the launcher or started by hand) gets a ``worker_id``, the run
                configuration and the store address;
- ``poll_view`` a waiting worker (first poll: it is *ready*) or a recovering one (``adopt``: its
                group broke) learns the newest adopted view that contains it, or ``wait``;
- ``get_view``  a training worker fetches the view of the epoch all workers agreed on (through
                their vote all-reduce); error ``view_broken`` while that epoch is being replaced;
- ``leave``     a worker asked to leave (SIGTERM) is removed from the next view; with
                ``finished``, a rank other than 0 trained its last step (its state: done);
- ``heartbeat`` metrics records in; latest epoch, stop flag and the broken epoch (if the adopted
                view lost a member: its workers abort that view's collectives) out; silent
                workers are dead;
- ``finish``    the final evaluation of the job; ``status`` a snapshot for progress displays;
- ``fail_job``  a worker stops the job for a reason all members agreed on (a non-finite value):
                the job's error line, and a stop.

Thread-safety: every handler runs on the message server's thread; ``snapshot``,
``remove_worker``, ``mark_left`` and ``settle_clocks``, called by the launcher
(``roles/coordinator_launcher.py``), take the same lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flotilla.cluster import rendezvous as rdv
from flotilla.cluster import rendezvous_events as ev
from flotilla.cluster.failure import FailurePolicy
from flotilla.cluster.lease import LeaseTerms
from flotilla.cluster.membership import View
from flotilla.cluster.peer_watch import PeerWatchPolicy
from flotilla.comm import shaping
from flotilla.comm.liveness import LivenessListener, LivenessWatch
from flotilla.comm.msgplane import Limits, serve
from flotilla.comm.store import StoreHost
from flotilla.config import RunConfig
from flotilla.core.errors import RemoteError
from flotilla.core.log import get_logger
from flotilla.report.trackers import config_text, make_tracker
from flotilla.roles.coordinator_end import EndSide
from flotilla.roles.coordinator_join import JoinSide
from flotilla.roles.coordinator_launcher import LauncherSide
from flotilla.roles.coordinator_progress import ProgressSide
from flotilla.roles.coordinator_protocol import BODIES
from flotilla.roles.coordinator_switch import SwitchAnnouncer
from flotilla.roles.link import HEARTBEAT_S
from flotilla.roles.members_lost import LostMembers
from flotilla.roles.metrics_sink import MetricsSink, WorkerInfo
from flotilla.sync.spec import ServiceFacts

log = get_logger("coordinator")
SWITCH_LEAD_S = 2.0  # an announced switch's step: beyond where every worker gets in this time (8 beats)

# heartbeats carry batches of metrics records in the msgpack header: allow 4 MiB headers on this
# control channel (workers cap a batch at MAX_RECORDS_PER_BEAT records, well below that)
COORDINATOR_LIMITS = Limits(max_message_bytes=16 * 2**20, max_header_bytes=4 * 2**20)


def rendezvous_config(cfg: RunConfig) -> rdv.RendezvousConfig:
    """The membership machine's settings: a member of a broken epoch is waited for one step
    timeout (a live one blocked in the broken collective has timed out and reported by then)."""
    policy = FailurePolicy(
        heartbeat_timeout_s=cfg.cluster.heartbeat_timeout_s,
        report_grace_s=cfg.strategy.collective_timeout_s(),
    )
    lease = LeaseTerms(lease_s=cfg.cluster.heartbeat_timeout_s, margin_s=HEARTBEAT_S)
    return rdv.RendezvousConfig(min_workers=cfg.cluster.effective_min_workers(), policy=policy, lease=lease)


class Coordinator(JoinSide, LauncherSide, ProgressSide, EndSide):
    """Coordinator service; ``start()`` binds the store and the message server.  ``now`` is the
    monotonic clock the membership machine is fed with (injectable for tests)."""

    def __init__(
        self,
        cfg: RunConfig,
        secret: bytes,
        *,
        port: int = 0,
        report_dir: str | Path | None = None,
        ps_servers: list[str] | None = None,
        now: Callable[[], float] = time.monotonic,
        files: dict[str, str | None] | None = None,
    ) -> None:
        self.cfg = cfg
        # (cluster.links.emulate: its servers' links; the previous shaping back at close)
        self._shaping_before = shaping.installed()
        shaping.install(cfg.cluster.link_shaping("coordinator"))
        self.ps_servers = list(ps_servers or [])
        self.files = dict(files or {})  # output/checkpoint/resume directories, for the workers
        self._secret = secret
        self._port = port
        self._now = now
        self._lock = threading.RLock()
        self._workers: dict[int, WorkerInfo] = {}
        self._peers: dict[int, str] = {}  # worker -> its peer endpoint (roles/peer_link.py)
        self._joins: dict[str, dict[str, Any]] = {}  # join token -> the reply it got (idempotent)
        # a peer's suspicion is corroborated by a silence here this long (the workers' own
        # heartbeats come every 0.25 s): see ev.Suspected
        self._suspect_silence_s = PeerWatchPolicy(interval_s=cfg.cluster.peer_heartbeat_s).corroboration_s
        self._rdv = rdv.initial_state(rendezvous_config(cfg))
        self._ring_heard: set[tuple[int, int]] = set()  # (worker, ring epoch) logged back
        self._final: dict[str, Any] = {}
        self._t0_unix = time.time()
        # strategy ps: the spread of the workers' clocks at common instants (clock_spread.py)
        rep = cfg.report
        tracker = make_tracker(  # (report/trackers.py: TensorBoard, MLflow)
            rep.trackers, report_dir, mlflow_uri=rep.mlflow_uri, mlflow_experiment=rep.mlflow_experiment
        )
        self._sink = MetricsSink(report_dir, clock_spread=cfg.launch_plan().clock_spread, tracker=tracker)
        if tracker is not None:
            tracker.text("config", config_text(cfg.to_dict()), 0)
            tracker.params(cfg.to_dict())
        self._store: StoreHost | None = None
        self._server: Any = None
        # workers hold a connection to it: it ends when this process dies (comm/liveness.py),
        # which is how they know the coordinator is gone and repair their ring without it
        self._live: LivenessListener | None = None
        # and it holds one to each worker's listener: a dead worker's ends at once
        self._watch: LivenessWatch | None = None
        self._watched: dict[int, tuple[str, int]] = {}
        self._lost = LostMembers(t0_unix=self._t0_unix, heartbeat_timeout_s=cfg.cluster.heartbeat_timeout_s)
        self._finished: set[int] = set()  # workers that reported their own last step (leave/finish)
        spec, stopped = cfg.strategy_spec, lambda: self._rdv.stop or self._rdv.done
        self._lost_at: list[float] = []  # when workers were declared dead (the adaptive policy's rate)
        facts = ServiceFacts(
            num_workers=len(cfg.cluster.resolved_workers()), now=now, stopped=stopped,
            speeds=cfg.run_facts().speeds, snapshot=self._snapshot,
            announce=self._announce,
        )  # fmt: skip
        # the strategy's own service (partial reduce's group controller), if its spec has one
        self._service = spec.service(cfg.strategy, facts) if spec.service is not None else None
        # announced strategy switches (coordinator_switch.py); news reaches a worker within a few beats
        self.switches = SwitchAnnouncer(total_steps=cfg.job.steps, lead_s=SWITCH_LEAD_S, live=self._progress)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Coordinator:
        host = self.cfg.cluster.host
        self._store = StoreHost(host, 0)
        self._live = LivenessListener(host)
        self._watch = LivenessWatch(self.worker_closed, name="coordinator")
        self._server = serve(
            self._secret, f"tcp://{host}:{self._port}", name="coordinator", limits=COORDINATOR_LIMITS
        )
        for op, (fn, schema) in self._handlers().items():
            self._server.register(op, fn, schema)
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
        if self._live is not None:
            self._live.close()
        if self._watch is not None:
            self._watch.close()
        self._sink.close()
        shaping.install(self._shaping_before)

    def _handlers(self) -> dict[str, tuple[Callable[[Any], dict[str, Any]], dict[str, Any]]]:
        """op -> (handler, body schema); the message plane rejects bodies that do not match."""
        h = {
            "join": self._on_join,
            "suspect": self._on_suspect,
            "poll_view": self._on_poll_view,
            "get_view": self._on_get_view,
            "leave": self._on_leave,
            "heartbeat": self._on_heartbeat,
            "finish": self._on_finish,
            "fail_job": self._on_fail_job,
        }
        return {
            **{op: (handler, BODIES[op]) for op, handler in h.items()},
            "status": (lambda req: self.snapshot(), {}),
            "describe": (lambda req: {"strategy": self.cfg.strategy.kind}, {}),
            **(self._service.handlers() if self._service is not None else {}),
            **self.switches.handlers(),
        }

    # ------------------------------------------------------------------ the state machine
    def _apply(self, event: ev.Event) -> ev.Reply:
        """Feed one event to the membership machine (under the lock); act on what it decided."""
        t = rdv.step(self._rdv, event)
        self._rdv = t.state
        for view in t.published:
            log.info("view %d: members %s", view.epoch, view.members)
        for view in t.adopted:
            log.info("view %d adopted: members %s joined %s left %s", *_view_fields(view))
            for wid in view.left:  # (one left behind without leaving: lost)
                if self._state_of(wid) in (rdv.WorkerState.SUSPECTED, rdv.WorkerState.DEAD):
                    self._note_lost(wid, event)
            for wid in view.joined:  # (a suspected one back under its own id)
                self._lost.back(wid)
        for wid in t.dead:
            self._lost_at.append(self._now())
            self._sink.close_clock(wid, keep=False)
            log.warning("worker %d (%s) declared dead", wid, self._workers[wid].name)
            if self._service is not None:
                self._service.on_dead(wid)
            self._note_lost(wid, event)
        if isinstance(t.reply, ev.Refused):
            raise RemoteError(t.reply.code, t.reply.message)
        return t.reply

    def _note_lost(self, wid: int, event: ev.Event) -> None:
        suspected = self._state_of(wid) is rdv.WorkerState.SUSPECTED
        if self._lost.note(wid, self._workers[wid].name, event, suspected=suspected):
            self._sink.event("lost", f"worker {wid} ({self._workers[wid].name})")

    def _announce(self, option: int) -> int:
        step = self.switches.announce(option)
        self._sink.event("switch", f"strategy option {option} from step {step}")
        return step

    def _state_of(self, wid: int) -> rdv.WorkerState:
        return self._rdv.workers[wid].state

    # ------------------------------------------------------------------ handlers
    def _on_poll_view(self, req: Any) -> dict[str, Any]:
        """A view newer than ``after_epoch`` containing the caller, once one is adopted and no
        failure round is open (``cluster/rendezvous.py`` states the rule)."""
        b = req.body
        event = ev.Polled(
            int(b["worker_id"]), int(b.get("after_epoch", 0)), bool(b.get("adopt")), self._now()
        )
        with self._lock:
            reply = self._apply(event)
        assert isinstance(reply, ev.PollReply)
        if reply.status is not ev.PollStatus.VIEW or reply.view is None:
            return {"status": reply.status.value}
        view, peers = reply.view, self._peers_of(reply.view)
        return {"status": "view", "view": view.to_dict(), "initial": reply.initial, "peers": peers}

    def _peers_of(self, view: View) -> dict[str, str]:
        """The peer endpoints of ``view``'s members (worker id as a string -> address)."""
        with self._lock:
            return {str(m): self._peers[m] for m in view.members if m in self._peers}

    def _on_get_view(self, req: Any) -> dict[str, Any]:
        """The view of the epoch the workers agreed on (by their vote); marks it adopted."""
        event = ev.ViewRequested(int(req.body["worker_id"]), int(req.body["epoch"]), self._now())
        with self._lock:
            reply = self._apply(event)
        assert isinstance(reply, ev.ViewReply)
        return {"view": reply.view.to_dict(), "peers": self._peers_of(reply.view)}

    def _on_suspect(self, req: Any) -> dict[str, Any]:
        """A worker's ring neighbours went silent (its peer watch) or their processes are gone
        (``closed``: their liveness connections ended): corroborated here (silence) or taken as
        proof (closed), a suspect is out of the views and the epoch broken at once
        (``ev.Suspected``)."""
        b = req.body
        suspects = b["suspects"]
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in suspects) or len(suspects) > 2:
            raise RemoteError("bad_request", "suspects: expected at most 2 worker ids")
        closed = bool(b["closed"])
        event = ev.Suspected(
            int(b["worker_id"]), tuple(suspects), self._suspect_silence_s, self._now(), closed=closed
        )
        with self._lock:
            self._apply(event)
            what = "gone" if closed else "silent"
            log.info("worker %d finds %s %s in epoch %d", event.reporter, suspects, what, int(b["epoch"]))
            return {"epoch": self._rdv.latest_epoch, "broken": rdv.broken_epoch(self._rdv)}

    def _on_leave(self, req: Any) -> dict[str, Any]:
        wid, finished = int(req.body["worker_id"]), bool(req.body.get("finished"))
        with self._lock:
            if finished:
                self._finished.add(wid)
            if wid in self._workers:
                self._sink.close_clock(wid, keep=True)
                if not finished:
                    self._note_left(wid, "it asked to leave (SIGTERM)")
            reply = self._apply(ev.LeaveRequested(wid, self._now(), finished=finished))
            facts = self.end_facts(wid) if finished and wid in self._workers else {}  # (standby: rdv.standby)
        assert isinstance(reply, ev.EpochReply)
        return {"epoch": reply.epoch, **({"standby": facts["standby"]} if "standby" in facts else {})}

    def _on_heartbeat(self, req: Any) -> dict[str, Any]:
        """Records in, membership news out; ``lease``: the worker's renewal (the stamp of a
        reply it received, ``lease_t``); ``ring``: it went on without this coordinator and is
        back (the heal: ``cluster/lease.py``)."""
        body = req.body
        wid = int(body["worker_id"])
        ring = _ring_view(body.get("ring"))
        with self._lock:
            info = self._workers.get(wid)
            trained = False
            if info is not None:
                trained = self._sink.ingest_batch(info, int(body.get("batch", -1)), body.get("records", []))
                if trained and self._sink.tracker is not None:
                    self._sink.flush_steps(self._slowest_live_step())
            stamp = body.get("lease")
            event: ev.Event = (
                ev.Heartbeat(
                    wid,
                    self._now(),
                    trained,
                    stamp=float(stamp) if stamp is not None else None,
                    runs=int(body.get("runs", 0)),
                )  # fmt: skip
                if ring is None
                else ev.RingReturned(wid, ring[0], ring[1], self._now(), trained)
            )
            if ring is not None and (wid, ring[0]) not in self._ring_heard:
                self._ring_heard.add((wid, ring[0]))
                log.warning("worker %d is back from ring mode in view %d %s", wid, *ring)
            reply = self._apply(event)
            assert isinstance(reply, ev.EpochReply)
            return {
                "lease_t": self._now(),
                "epoch": reply.epoch,
                "stop": self._rdv.stop or self._rdv.done,
                "broken": rdv.broken_epoch(self._rdv),
                **self.end_facts(wid),  # (gone; who reports the job's result if its rank 0 is gone)
                "switches": self.switches.announced(),
            }


def _ring_view(raw: Any) -> tuple[int, tuple[int, ...]] | None:
    """A heartbeat's ``ring`` (``{epoch, members}``, or ``{}`` before any view): bounded ints."""
    if raw is None:
        return None
    if raw == {}:
        return (0, ())
    epoch, members = raw.get("epoch"), raw.get("members")
    ok = (
        type(epoch) is int and 0 <= epoch <= 2**53 and isinstance(members, list) and len(members) <= 4096
        and all(type(m) is int and 0 <= m < 2**31 for m in members)
    )  # fmt: skip
    if not ok:
        raise RemoteError("bad_request", "ring: expected {epoch: int >= 0, members: [worker ids]}")
    return epoch, tuple(sorted(set(members)))


def _view_fields(view: Any) -> tuple[Any, ...]:
    return (view.epoch, view.members, view.joined, view.left)
