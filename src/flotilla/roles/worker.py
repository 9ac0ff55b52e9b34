"""The worker role: a model replica under any :class:`SyncStrategy` (``allreduce``, ``ps``, or one
registered in ``sync/registry.py``).  It only ASSEMBLES the parts of the one loop
(``trainer/loop.py``) and runs it:

- Membership: ``roles/coordinated.CoordinatedMembership`` (views from the coordinator);
- Engine: ``trainer/replica.ReplicaEngine`` (forward/backward of this worker's shard);
- SyncStrategy: built from the registry for option 0 (the job's strategy) or a switch option;
- Duties (``roles/worker_duties.py``): restore, checkpoint, evaluate, report the result;
- Records (``roles/worker_records.Recorder``): metrics through the coordinator link.

Life of a worker: ``join`` the coordinator (worker id, run configuration, store address, PS
servers), build the task, model, optimizer and data, then ``Loop.run``.  SIGTERM means "leave":
at the next step boundary (a barrier strategy's vote moves every member to the view without this
worker), or at once (no barrier: e.g. ``ps`` leaves the servers).
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time
from typing import Any

import torch

from flotilla.cluster.emulation import SpeedEmulator, TransientSlowdown, no_wait
from flotilla.cluster.lease import LeaseTerms
from flotilla.cluster.membership import View
from flotilla.cluster.peer_watch import PeerWatchPolicy
from flotilla.cluster.rejoin import after_session
from flotilla.comm import shaping
from flotilla.comm.addresses import WILDCARDS, split_host_port
from flotilla.comm.store import StoreAddress
from flotilla.config import RunConfig, validate_config
from flotilla.core.errors import CallTimeout, CommError, ConfigError, FlotillaError, RemoteError
from flotilla.core.faults import FaultInjector, FaultPlan
from flotilla.core.log import get_logger
from flotilla.core.threads import use_torch_threads
from flotilla.roles import worker_files
from flotilla.roles.coordinated import EXIT_EVICTED, CoordinatedMembership
from flotilla.roles.link import HEARTBEAT_S, CoordinatorLink
from flotilla.roles.peer_link import PeerLink
from flotilla.roles.ring_driver import RingDriver
from flotilla.roles.strategy_peers import StrategyPeers
from flotilla.roles.worker_duties import WorkerDuties
from flotilla.roles.worker_records import Recorder, WorkerOptions
from flotilla.sync import registry
from flotilla.sync.base import SyncStrategy
from flotilla.trainer import builders, optim
from flotilla.trainer.boundary import BoundaryPolicy
from flotilla.trainer.builders import strategy_options_of
from flotilla.trainer.loop import Loop, LoopParts
from flotilla.trainer.precision import autocast_of, compile_model, loss_scaler_of
from flotilla.trainer.replica import ReplicaEngine, attach_scaler
from flotilla.trainer.step import stretch_optimizer_steps, task_loss

__all__ = ["Worker", "WorkerOptions", "run_worker"]

log = get_logger("worker")

JOIN_TRY_S = 5.0  # one join attempt's wait for the reply
JOIN_WAIT_S = 60.0  # how long a worker keeps sending its join to a silent coordinator


class Strategies:
    """Option 0: the job's (first) strategy; then the others a kind that runs several switches
    between (``adaptive``), then ``opts.switch_options`` (kind, package config)."""

    def __init__(self, worker: Worker, options: list[tuple[str, Any]]) -> None:
        self.worker, self.options = worker, options

    def describe(self, option: int) -> str:
        return self.options[option][0]

    def known(self, option: int) -> bool:
        return 0 <= option < len(self.options)

    def __call__(self, option: int, view: View) -> SyncStrategy:
        kind, config = self.options[option]
        w = self.worker
        ctx = registry.StrategyContext(
            worker_id=w.worker_id,
            rank=view.rank_of(w.worker_id),
            num_workers=view.world_size,
            secret=w.opts.secret,
            servers=w.servers,
            on_bucket_ready=w.bucket_ready,
            groups=w.membership.groups,
            members=view.members,
            epoch=view.epoch,
            gone=lambda: w.link.gone,
            coordinator=w.link,
            peers=w.strategy_peers,
            joined=w.loop is not None and not w.loop.p.engine.has_state,
        )
        strategy = registry.build(kind, w.model, w.optimizer, config, ctx)
        attach_scaler(strategy, w.scaler)  # (before a resumed checkpoint's state reaches it)
        if option == 0 and w.duties is not None:  # the state of the checkpoint it resumed from
            w.duties.resume_strategy(strategy, ctx.rank, ctx.num_workers)
        return strategy


def run_worker(opts: WorkerOptions) -> int:
    """Run the worker's sessions until one ends for good: a session the job went on without
    (evicted: frozen past the heartbeat timeout, cut off) is followed by a fresh one -- nothing
    of the old one kept, the same name, the current state from a live replica -- as
    ``cluster/rejoin.py`` decides.  Returns the last session's exit code."""
    idle, sessions = 0, 0
    while True:
        worker = Worker(opts)
        try:
            code = worker.run()
        except RemoteError as exc:
            if sessions and exc.code == "job_over":  # woken after the end: nothing to rejoin
                log.error("worker %s: the job has finished while it was out; exiting", opts.name)
                return EXIT_EVICTED
            raise
        sessions += 1
        membership = getattr(worker, "membership", None)
        ring_mode = membership is not None and membership.ring_mode
        verdict = after_session(
            evicted=code == EXIT_EVICTED,
            commits=worker.loop.commits if worker.loop is not None else 0,
            idle=idle,
            coordinator=not (worker.link.coordinator_gone or ring_mode),
        )
        if not verdict.rejoin:
            if code == EXIT_EVICTED:
                log.error("worker %d (%s): %s; exiting", worker.worker_id, opts.name, verdict.why)
            return code
        idle = verdict.idle
        log.warning("worker %d (%s): %s", worker.worker_id, opts.name, verdict.why)


class Worker:
    def __init__(self, opts: WorkerOptions) -> None:
        self.opts = opts
        # (a sender of its own per process: a second worker started by mistake with the same name
        # must not get this one's messages refused as replays before the coordinator refuses it)
        self.link = CoordinatorLink(
            opts.coordinator, opts.secret, sender=f"worker-{opts.name or 'x'}-{os.getpid()}"
        )
        self.faults = FaultInjector(opts.faults or FaultPlan(), opts.name)  # (tests: core/faults.py)
        self.peers = PeerLink(opts.secret, beside=opts.coordinator, name=opts.name or str(os.getpid()))
        self.loop: Loop | None = None
        self.duties: WorkerDuties | None = None
        self.leave = threading.Event()  # SIGTERM: leave at the next boundary

    def run(self) -> int:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self.leave.set())
        try:
            self._setup()
            self.loop = Loop(self._parts())
            self.loop.boundary_hooks.extend(self.opts.boundary_hooks)
            if self.faults.active:
                self.loop.boundary_hooks.append(self.faults.boundary_hook)
            try:
                code = self.loop.run()
            except (CommError, FlotillaError) as exc:
                # (the job went on without it -- frozen past the heartbeat timeout, cut off -- and
                # what it did next was refused, e.g. by the servers that evicted it: not a failure)
                if isinstance(exc, ConfigError) or not self.membership.removed():
                    raise
                log.warning("worker %d: its session ended evicted (%s)", self.worker_id, exc)
                return EXIT_EVICTED
            except Exception as exc:  # (the task's code raised: job.on_error; the traceback follows)
                out = self.membership.removed()  # (the job went on without it: not the job's error)
                if self.duties is not None and not out and not isinstance(exc, torch.OutOfMemoryError):
                    self.duties.task_error(self.loop.step, exc)
                raise
            return EXIT_EVICTED if code == 0 and self.membership.evicted else code  # (logged why)
        except torch.OutOfMemoryError as exc:  # (the job stops: one line naming the worker)
            raise builders.out_of_memory(f"worker {self.opts.name!r}", self.device, exc) from None
        finally:
            self._shutdown()

    def _join(self, body: dict[str, Any]) -> dict[str, Any]:
        """``join``, sent again with the same token while unanswered (a lost request or reply: the
        coordinator answers a repeated token with the first admission) for up to ``JOIN_WAIT_S``."""
        deadline = time.monotonic() + JOIN_WAIT_S
        while True:
            try:
                return self.link.call("join", body, timeout_s=JOIN_TRY_S)
            except CallTimeout as exc:
                if time.monotonic() >= deadline:
                    raise
                log.warning("join was not answered (%s): sending it again", exc)

    def bucket_ready(self, _bucket: int) -> None:
        self.emulator.mark()  # stretch backward up to this bucket

    def _setup(self) -> None:
        body = {
            "name": self.opts.name,
            "speed": self.opts.speed,
            "pid": os.getpid(),
            "peer_address": self.peers.address,
            "live_port": self.peers.live_port or None,  # the coordinator watches it (comm/liveness)
            "join_token": secrets.token_hex(16),  # a join sent again is recognised as this one
        }
        self._await_coordinator()
        reply = self._join(body)
        self.worker_id = int(reply["worker_id"])
        self.cfg: RunConfig = validate_config(reply["config"])
        self.servers = tuple(reply.get("ps_servers") or ())
        self.t0_unix, self.speed = float(reply["t0_unix"]), float(reply["speed"])
        self.files = worker_files.JobFiles.from_reply(reply.get("files"))
        shaping.install(self.cfg.cluster.link_shaping(self.opts.name or f"x{self.worker_id}"))
        if self.files.output_dir is not None:  # (where records go if the coordinator dies)
            name = self.opts.name or f"x{self.worker_id}"
            self.link.spool_path = self.files.output_dir / f"records-{name}.jsonl"
            self.link.spool_fields = {"name": name, "worker_id": self.worker_id}
        lease = LeaseTerms(lease_s=self.cfg.cluster.heartbeat_timeout_s, margin_s=HEARTBEAT_S)
        self.link.start_heartbeat(self.worker_id, lease)  # (cluster/lease.py: silence starts ring mode)
        self.link.watch_coordinator(int(reply.get("live_port") or 0))
        ring = RingDriver(self.worker_id, self.opts.secret)
        ring.register(self.peers.server)
        use_torch_threads()
        self.task = builders.build_task(self.cfg)
        self.train_data, self.eval_data = builders.build_task_data(self.task)
        self.device = builders.worker_device(self.cfg, self.opts.name)  # cpu or this rank's GPU
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.transport = builders.collective_backend(self.cfg, self.device)  # gloo or nccl
        self.model = builders.build_task_model(self.cfg, self.task).to(self.device)
        compile_model(self.model, self.cfg.job.compile, self.cfg.job.compile_backend)
        self.sampler = builders.task_sampler(self.cfg, self.train_data, self.model)
        self.total_steps = builders.total_steps(self.cfg, self.sampler)
        self.opt = optim.build_optimizer(self.cfg, self.model, self.task, total_steps=self.total_steps)
        self.optimizer = self.opt.optimizer
        self.scaler = loss_scaler_of(self.cfg.job.precision)  # fp16: this replica's loss scale
        self.options = strategy_options_of(self.cfg, self.total_steps)  # option 0: the first strategy
        slowdown = TransientSlowdown.of(
            self.cfg.cluster.worker(self.opts.name or "").slowdown, self.worker_id
        )
        cuda = self.device.type == "cuda"  # (a host wait is not the device's: cluster/emulation.py)
        self.emulator = SpeedEmulator(self.speed, slowdown=slowdown, waited=no_wait if cuda else None)
        stretch_optimizer_steps(self.optimizer, self.emulator, self.device)  # (its update too: SPEC §8)
        policy = PeerWatchPolicy(interval_s=self.cfg.cluster.peer_heartbeat_s)
        self.membership = CoordinatedMembership(
            self.link,
            self.worker_id,
            self._store_address(reply),
            timeout_s=self.cfg.strategy.collective_timeout_s(),
            backend=self.transport,
            device=self.device,
            view_wait_s=self.opts.view_wait_s,
            leave=self.leave,
            peers=self.peers,
            ring=ring,
            stall_limit_s=policy.unsuspected_s,
            faults=self.faults if self.faults.active else None,
        )
        name = self.opts.name or f"x{self.worker_id}"
        self.strategy_peers = StrategyPeers(
            self.peers.server, self.membership.peer_address, self.opts.secret, name
        )
        self.peers.start(self.worker_id, policy, self.membership.on_suspect)
        self.on_abort = self.cfg.strategy.abort_rule()
        log.info(
            "worker %d (%s) speed %.2f joined; computes on %s (%s), collectives over %s",
            self.worker_id,
            self.opts.name,
            self.speed,
            self.device,
            torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "host",
            self.transport,
        )

    def _await_coordinator(self) -> None:
        """Wait (up to ``opts.coordinator_wait_s``) until the coordinator answers: a scheduler
        may start the workers before it listens.  Asked with ``describe``, which changes nothing:
        a join that timed out could still arrive late and register this worker twice."""
        deadline = time.monotonic() + self.opts.coordinator_wait_s
        said = False
        while True:
            try:
                self.link.call("describe", {}, timeout_s=2.0)
                return
            except CallTimeout:
                if time.monotonic() >= deadline:
                    raise CommError(
                        f"the coordinator at {self.opts.coordinator} did not answer within "
                        f"{self.opts.coordinator_wait_s:g} s: is it running, and can this host reach "
                        "that address and port? (docs/multihost.md)"
                    ) from None
                if not said:
                    log.info("waiting for the coordinator at %s", self.opts.coordinator)
                    said = True

    def _store_address(self, reply: dict[str, Any]) -> StoreAddress:
        """The coordinator's store; one bound on every interface (``cluster.host: 0.0.0.0``)
        is reached at the host this worker dialled.  Logs the addresses this worker uses."""
        host = str(reply["store_host"])
        if host in WILDCARDS:
            host = split_host_port(self.opts.coordinator)[0]
        address = StoreAddress(host, int(reply["store_port"]))
        log.info(
            "addresses: coordinator %s, peer server %s, store %s:%d",
            self.opts.coordinator,
            self.peers.address,
            address.host,
            address.port,
        )
        return address

    def _parts(self) -> LoopParts:
        cfg = self.cfg
        engine = ReplicaEngine(
            model=self.model,
            optimizer=self.optimizer,
            train_data=self.train_data,
            sampler=self.sampler,
            loss_fn=task_loss(self.task),
            emulator=self.emulator,
            device=self.device,
            seed=cfg.job.seed,
            accumulate=cfg.job.accumulate,
            scheduler=self.opt.scheduler,
            autocast=autocast_of(cfg.job.precision, self.device),
            scaler=self.scaler,
        )
        recorder = Recorder(
            self.link,
            cfg,
            self.sampler,
            t0_unix=self.t0_unix,
            speed=self.speed,
            task=self.task,
            emulation=self.emulator.record_fields,
            device=str(self.device),
            transport=self.transport,
        )
        duties = self.duties = WorkerDuties(self, engine, recorder)
        ck = cfg.checkpoint if duties.checkpointer.enabled else None
        policy = BoundaryPolicy(
            total_steps=self.total_steps,
            on_abort=self.on_abort,
            on_nonfinite=cfg.job.nonfinite,
            max_nonfinite=cfg.job.max_nonfinite,
            eval_every_steps=cfg.job.eval_every_steps,
            checkpoint_every_steps=(ck.every_steps or 0) if ck is not None else 0,
            checkpoint_every_s=(ck.every_s or 0.0) if ck is not None else 0.0,
            switch_plan=self.opts.switch_plan,
        )
        return LoopParts(
            membership=self.membership,
            engine=self.faults.engine(engine),
            strategies=Strategies(self, [*self.options, *self.opts.switch_options]),
            duties=duties,
            records=recorder,
            policy=policy,
            name=self.opts.name or "",
            switch_requests=self.opts.switch_requests,
        )

    def _shutdown(self) -> None:
        if self.duties is not None:
            try:  # (a checkpoint still being written in the background is finished, not dropped)
                self.duties.checkpointer.flush()
            except Exception as exc:
                log.error("the last checkpoint was not written: %s", exc)
        try:
            self.link.flush(timeout_s=2.0)
        except Exception:
            pass
        log.debug("records flushed")
        self.peers.close()
        membership = getattr(self, "membership", None)
        if membership is not None:
            membership.close()
        log.debug("groups closed")
        self.link.close()
        log.debug("link closed")
