"""The worker role: one model replica training with any data-parallel :class:`SyncStrategy`
(``allreduce``, ``ps``, or one registered in ``sync/registry.py``).  ONE loop for all of them.

Life of a worker
1. ``join`` the coordinator: get a ``worker_id``, the run configuration, the store address and
   (strategy ps) the servers' addresses.
2. Wait until a view containing it is adopted; build the strategy from the registry.  A collective
   strategy gets that epoch's process group, and the replicas agree on the most advanced one
   (``sync/plan.choose_donor``) which sends its state (parameters, optimizer state, step) if
   needed.  A non-collective one (ps) brings its own state (``start`` pulls the global weights);
   its membership is fixed, so a worker joining after the job started is refused.
3. Train, one commit unit at a time (``trainer/step.run_unit``).  A collective strategy's vote
   carries the newest membership epoch this worker knows of (heartbeat or its own leave request),
   so all workers switch views at the same step boundary, in-process; a collective failure
   discards the step everywhere, and the worker recovers into the coordinator's next view.
4. At every step boundary ``boundary_hooks`` may act, e.g. ``switch_strategy`` (the switching
   policy itself is not here).
5. SIGTERM means "leave": at the next step boundary (collective), or at once (non-collective:
   the strategy leaves the PS).  Rank 0 evaluates every ``job.eval_every_steps`` steps and, at the
   end, the job's final weights (``strategy.finalize``), and reports the result.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from flotilla.cluster.emulation import SpeedEmulator
from flotilla.cluster.membership import View
from flotilla.comm.collective import EpochGroup, StoreAddress, broadcast_state, connect_store
from flotilla.config import RunConfig, validate_config
from flotilla.core.errors import CollectiveError, CommError, FlotillaError
from flotilla.core.log import get_logger
from flotilla.core.threads import use_torch_threads
from flotilla.roles import worker_files
from flotilla.roles.link import CoordinatorLink
from flotilla.roles.worker_records import Recorder, StepInfo, WorkerOptions, strategy_config, test_metrics
from flotilla.sync import registry
from flotilla.sync.allreduce import AllReduceConfig
from flotilla.sync.base import Outcome, SyncStrategy
from flotilla.sync.plan import NO_STATE, StateProbe, choose_donor, donor_rank
from flotilla.sync.state import export_state, import_state, model_digest
from flotilla.trainer import builders
from flotilla.trainer.step import Minibatch, run_unit, summed_loss
from flotilla.trainer.task_load import evaluate_task

__all__ = ["Worker", "WorkerOptions"]

log = get_logger("worker")


class Worker:
    def __init__(self, opts: WorkerOptions) -> None:
        self.opts = opts
        self.link = CoordinatorLink(
            opts.coordinator, opts.secret, sender=f"worker-{opts.name or os.getpid()}"
        )
        self.leave_requested = False
        self._leave_epoch = 0
        self.group: EpochGroup | None = None
        self.view: View | None = None
        self.strategy: SyncStrategy | None = None
        self.step = 0
        self.has_state = False
        self.boundary_hooks: list[Callable[[Worker], None]] = []

    # ------------------------------------------------------------------ entry point
    def run(self) -> int:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: setattr(self, "leave_requested", True))
        try:
            self._setup()
            if not self._recover(after_epoch=0, adopt=False):
                return 0
            return self._train()
        finally:
            self._shutdown()

    def _setup(self) -> None:
        reply = self.link.call("join", {"name": self.opts.name, "speed": self.opts.speed, "pid": os.getpid()})
        self.worker_id = int(reply["worker_id"])
        self.cfg: RunConfig = validate_config(reply["config"])
        self.kind, self.sync_config = strategy_config(self.cfg)
        ar = self.sync_config if isinstance(self.sync_config, AllReduceConfig) else AllReduceConfig()
        self.step_timeout_s, self.on_abort = ar.step_timeout_s, ar.on_abort
        self.servers = tuple(reply.get("ps_servers") or ())
        self._store_address = StoreAddress(reply["store_host"], int(reply["store_port"]))
        self.store: Any = None  # connected when a collective strategy first needs a group
        self.t0_unix, self.speed = float(reply["t0_unix"]), float(reply["speed"])
        self.link.start_heartbeat(self.worker_id)
        use_torch_threads()  # one intra-op thread per worker (core/threads.py)
        self.task = builders.build_task(self.cfg)
        self.train_data, self.eval_data = builders.build_task_data(self.task)
        self.device = builders.worker_device(self.cfg, self.opts.name)  # cpu or this rank's GPU
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model = builders.build_task_model(self.cfg, self.task).to(self.device)
        self.loss_fn = summed_loss(self.task)
        self.optimizer = builders.build_optimizer(self.cfg, self.model)
        self.sampler = builders.task_sampler(self.cfg, self.train_data)
        self.files = worker_files.JobFiles.from_reply(reply.get("files"))
        self.checkpointer = worker_files.Checkpointer(self.cfg, self.files)
        self.total_steps = builders.total_steps(self.cfg, self.sampler)
        self.emulator = SpeedEmulator(self.speed)
        self.recorder = Recorder(self.link, self.cfg, self.sampler, t0_unix=self.t0_unix, speed=self.speed)
        log.info("worker %d (%s) speed %.2f joined", self.worker_id, self.opts.name, self.speed)

    @property
    def rank(self) -> int:
        assert self.view is not None
        return self.view.rank_of(self.worker_id)

    def _sync(self) -> SyncStrategy:
        assert self.strategy is not None
        return self.strategy

    # ------------------------------------------------------------------ strategies
    def _build_strategy(self, kind: str, config: Any) -> SyncStrategy:
        assert self.view is not None
        ctx = registry.StrategyContext(
            worker_id=self.worker_id,
            rank=self.rank,
            num_workers=self.view.world_size,
            secret=self.opts.secret,
            servers=self.servers,
            on_bucket_ready=self._bucket_ready,
            fault_hook=self.opts.fault_hook,
        )
        strategy = registry.build(kind, self.model, self.optimizer, config, ctx)
        if strategy.traits.collective:
            if self.group is None:
                self.group = self._make_group(self.view)
            strategy.bind(self.group)
        return strategy

    def _bucket_ready(self, _bucket: int) -> None:
        self.emulator.mark()  # stretch backward up to this bucket

    def switch_strategy(self, kind: str, config: Any) -> None:
        """At a step boundary: close the current strategy and continue with a new one of ``kind``.
        Every replica of a collective strategy must switch at the same step."""
        old = self._sync()
        old.close()
        self.strategy = self._build_strategy(kind, config)
        self.kind, self.sync_config = kind, config
        self.strategy.start()
        if self.strategy.traits.collective:  # replicas agree again (e.g. after local steps)
            self._sync_state(True)
        log.info("worker %d switched strategy %s -> %s at step %d", self.worker_id, old.kind, kind, self.step)

    # ------------------------------------------------------------------ membership
    def _recover(self, *, after_epoch: int, adopt: bool) -> bool:
        """Wait for a view newer than ``after_epoch`` that contains us and move into it."""
        deadline = time.monotonic() + self.opts.view_wait_s
        while time.monotonic() < deadline:
            if self.link.orphaned:
                raise FlotillaError("coordinator lost: no answer to heartbeats")
            reply = self.link.call(
                "poll_view", {"worker_id": self.worker_id, "after_epoch": after_epoch, "adopt": adopt}
            )
            if reply["status"] in ("done", "removed"):
                return False
            if reply["status"] == "view":
                view = View.from_dict(reply["view"])
                if self.view is None:
                    # members of the job's first view hold the seeded (or resumed) initial model;
                    # a worker joining later holds nothing until a replica sends it
                    self.has_state = bool(reply.get("initial"))
                    if self.has_state:
                        self.step = (
                            worker_files.restore(self.cfg, self.files, self.model, self.optimizer) or 0
                        )
                if self.worker_id not in view.members:
                    return False
                try:
                    self._enter(view)
                    return True
                except CollectiveError as exc:
                    log.warning("epoch %d rendezvous failed (%s); waiting for a newer view", view.epoch, exc)
                    after_epoch, adopt = view.epoch, True
                    continue
            time.sleep(0.05)
        raise FlotillaError(f"no view containing worker {self.worker_id} within {self.opts.view_wait_s} s")

    def _enter(self, view: View) -> None:
        if self.strategy is None:  # the first view: build the strategy in it
            self.view = view
            self.strategy = self._build_strategy(self.kind, self.sync_config)
            if not self.strategy.traits.collective:
                if not self.has_state:
                    raise FlotillaError(
                        f"strategy {self.kind} has a fixed membership: "
                        "this worker joined after the job started"
                    )
                self.strategy.start()
                return
            self._sync_state(True)
            self._log_view()
            return
        self._adopt(view, force_sync=True)

    def _make_group(self, view: View) -> EpochGroup:
        if self.store is None:
            self.store = connect_store(self._store_address)
        return EpochGroup(
            self.store,
            epoch=view.epoch,
            rank=view.rank_of(self.worker_id),
            world_size=view.world_size,
            timeout_s=self.step_timeout_s,
            backend=builders.collective_backend(self.cfg, self.device),
            device=self.device,
        )

    def _adopt(self, view: View, *, force_sync: bool) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self.view = view
        self.group = self._make_group(view)
        self._sync().bind(self.group)
        self._sync_state(force_sync or bool(view.joined))
        self._log_view()

    def _log_view(self) -> None:
        assert self.view is not None
        log.info(
            "worker %d adopted view %d (rank %d of %d) at step %d",
            self.worker_id,
            self.view.epoch,
            self.rank,
            self.view.world_size,
            self.step,
        )

    def _sync_state(self, wanted: bool) -> None:
        """Agree on the most advanced replica and, if anyone needs it, broadcast its state."""
        g, view = self.group, self.view
        assert g is not None and view is not None
        mine = self.step if self.has_state else NO_STATE
        probe = torch.tensor([float(wanted), float(mine), -float(mine)], dtype=torch.float64)
        g.allreduce(probe, op="max")
        wanted_v, max_v, neg_min_v = probe.tolist()
        choice = choose_donor(
            StateProbe(wanted=wanted_v > 0, max_step=int(max_v), min_step=int(-neg_min_v)), epoch=view.epoch
        )
        if not choice.transfer:
            return
        holder = torch.tensor([float(donor_rank(g.rank, mine, choice.step, g.world_size))])
        g.allreduce(holder, op="min")
        src = int(holder.item())
        if g.rank == src:
            meta, tensors = export_state(self.model, self.optimizer, {"step": self.step})
            broadcast_state(g, src, meta, tensors)
        else:
            meta, tensors = broadcast_state(g, src, None, None)
            self.step = int(import_state(self.model, self.optimizer, meta, tensors)["step"])
            self.has_state = True

    def _transition(self, epoch: int) -> bool:
        """Move to the agreed view ``epoch``; False if this worker is not in it (it left)."""
        reply = self.link.call("get_view", {"worker_id": self.worker_id, "epoch": epoch})
        view = View.from_dict(reply["view"])
        if self.worker_id not in view.members:
            return False
        self._adopt(view, force_sync=False)
        return True

    def _pending_epoch(self) -> int:
        assert self.view is not None
        if self.leave_requested and not self._leave_epoch:
            self._leave_epoch = int(self.link.call("leave", {"worker_id": self.worker_id})["epoch"])
        latest = max(self.link.latest_epoch, self._leave_epoch)
        return latest if latest > self.view.epoch else 0

    # ------------------------------------------------------------------ training
    def _train(self) -> int:
        while self.step < self.total_steps:
            if self.link.orphaned:
                log.error("coordinator lost: exiting")
                return 3
            if not self._sync().traits.collective and self._stops_locally():
                return 0
            epoch = self._epoch()
            try:
                outcome = self._one_unit()
            except CollectiveError as exc:
                log.warning("step %d discarded: %s", self.step, exc)
                self.recorder.discarded(self.step, epoch, str(exc))
                if not self._recover(after_epoch=epoch, adopt=True):
                    return 0
                continue
            if outcome.stop:  # (the stop arrived during the unit; a vote or the PS path reports it)
                log.info("stop requested by the coordinator at step %d", self.step)
                return 0
            if outcome.pending_epoch > epoch and not self._change_view(outcome.pending_epoch):
                return 0
            for hook in list(self.boundary_hooks):
                hook(self)
        return self._finish()

    def _stops_locally(self) -> bool:
        """A non-collective strategy stops (and leaves) at once when asked; no vote needed."""
        if self.link.stop_requested:
            log.info("stop requested by the coordinator at step %d", self.step)
        elif self.leave_requested:
            log.info("worker %d leaves at step %d (SIGTERM)", self.worker_id, self.step)
        return self.link.stop_requested or self.leave_requested

    def _epoch(self) -> int:
        assert self.view is not None
        return self.view.epoch

    def _change_view(self, epoch: int) -> bool:
        try:
            if not self._transition(epoch):
                log.info("worker %d left at step %d", self.worker_id, self.step)
                return False
        except (CollectiveError, CommError) as exc:
            log.warning("transition failed: %s", exc)
            return self._recover(after_epoch=self._epoch(), adopt=True)
        return True

    def _one_unit(self) -> Outcome:
        sync = self._sync()
        collective, k = sync.traits.collective, sync.traits.steps_per_commit
        assert self.view is not None
        rank, world = self.rank, self.view.world_size
        batches = []
        for s in range(self.step, min(self.step + k, self.total_steps)):
            idx = self.sampler.shard(s, rank, world)
            x, y = self.train_data.batch(idx)
            batches.append(Minibatch(s, x.to(self.device), y.to(self.device)))
        gbatch = self.sampler.global_batch_size
        if not sync.traits.nominal_batch:
            gbatch = len(self.sampler.global_batch(self.step))
        t0 = time.perf_counter()
        res = run_unit(
            self.model,
            sync,
            batches,
            global_batch=gbatch,
            emulator=self.emulator,
            pending_epoch=self._pending_epoch() if collective else 0,
            stop=self.link.stop_requested,
            loss_fn=self.loss_fn,
        )
        last, d = batches[-1].step, res.decision
        at = StepInfo(last, self._epoch(), rank, world, time.perf_counter() - t0)
        flush = d.committed and (last >= self.total_steps - 1 or d.pending_epoch > at.membership_epoch)
        digest = (lambda: model_digest(self.model)) if collective else None
        self.recorder.unit(res, at, flush=flush, extra=sync.record_fields(), digest=digest)
        if d.committed or self.on_abort == "drop":
            self.step = last + 1
            if d.committed and collective and self.rank == 0 and self.checkpointer.due(self.step):
                self.checkpointer.write(self.model, self.optimizer, self.step)
            self._maybe_evaluate(k)
        return d

    def _maybe_evaluate(self, unit: int) -> None:
        every = self.cfg.job.eval_every_steps
        if self.rank == 0 and every and (self.step // unit) % every == 0 and self.step < self.total_steps:
            self._sync().before_eval()
            self._evaluate_and_record()

    def _evaluate_and_record(self) -> dict[str, float]:
        ev = evaluate_task(self.task, self.model, self.eval_data)
        self.recorder.evaluation(self.step, ev)
        return ev

    def _finish(self) -> int:
        if self.rank != 0 or not self._sync().finalize(lambda: self.link.stop_requested):
            return 0
        ev = self._evaluate_and_record()
        self.link.flush()
        result: dict[str, Any] = {**test_metrics(ev), "steps": self.step}
        if self._sync().traits.collective:
            result["digest"] = model_digest(self.model)
        model_file = worker_files.export(self.files, self.model)
        if model_file is not None:
            result["model_file"] = str(model_file)
        self.link.call("finish", {"worker_id": self.worker_id, "result": result})
        return 0

    def _shutdown(self) -> None:
        try:
            self.link.flush(timeout_s=2.0)
        except Exception:
            pass
        if self.strategy is not None:
            self.strategy.close()
        if self.group is not None:
            self.group.close()
        self.link.close()
