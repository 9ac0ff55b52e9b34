"""The worker role: one model replica training with strategy ``allreduce``.

Life of a worker
1. ``join`` the coordinator: get a ``worker_id``, the run configuration and the store address.
2. Wait until a view containing it is adopted; build that epoch's process group; agree on the
   most advanced replica and receive its state (parameters, optimizer state, step) if needed.
3. Train: each step's vote carries the newest membership epoch this worker knows of (heartbeat or
   its own leave request), so all workers switch views at the same step boundary, in-process.
4. A collective failure discards the step everywhere (atomic step); the worker then waits for the
   coordinator to publish a view without the lost peer and recovers into it.
5. SIGTERM means "leave": the leave takes effect at the next step boundary and the process exits 0.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch

from flotilla.cluster.emulation import SpeedEmulator
from flotilla.cluster.membership import View
from flotilla.comm.collective import EpochGroup, StoreAddress, broadcast_state, connect_store
from flotilla.config import RunConfig, validate_config
from flotilla.core.errors import CollectiveError, CommError, FlotillaError
from flotilla.core.log import get_logger
from flotilla.core.threads import use_torch_threads
from flotilla.roles.link import CoordinatorLink
from flotilla.sync.allreduce import BucketedAllReduce
from flotilla.sync.state import export_state, import_state, model_digest
from flotilla.trainer import builders
from flotilla.trainer.step import run_step

log = get_logger("worker")


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerOptions:
    coordinator: str  # tcp://host:port of the coordinator
    secret: bytes
    name: str | None = None
    speed: float | None = None  # overrides the configured speed of this worker
    crash_at_step: int | None = None  # fault injection for tests: die mid-step (see _fault_hook)
    view_wait_s: float = 120.0


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
        self.step = 0
        self._unrecorded = (0, 0.0)  # samples and step time of steps not recorded yet
        self.has_state = False

    # ------------------------------------------------------------------ entry point
    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "leave_requested", True))
        try:
            self._setup()
            if not self._await_first_view():
                return 0
            return self._train()
        finally:
            self._shutdown()

    def _setup(self) -> None:
        reply = self.link.call("join", {"name": self.opts.name, "speed": self.opts.speed, "pid": os.getpid()})
        self.worker_id = int(reply["worker_id"])
        self.cfg: RunConfig = validate_config(reply["config"])
        self.store = connect_store(StoreAddress(reply["store_host"], int(reply["store_port"])))
        self.t0_unix = float(reply["t0_unix"])
        self.speed = float(reply["speed"])
        self.link.start_heartbeat(self.worker_id)
        torch.manual_seed(self.cfg.job.seed)
        use_torch_threads()  # one intra-op thread per worker (core/threads.py)
        self.data = builders.build_dataset(self.cfg)
        self.x_train, self.y_train = self.data.train_tensors()
        self.x_test, self.y_test = self.data.test_tensors()
        self.model = builders.build_model_for(self.cfg, self.data)
        self.optimizer = builders.build_optimizer(self.cfg, self.model)
        self.sampler = builders.build_sampler(self.cfg, self.data)
        self.total_steps = builders.total_steps(self.cfg, self.sampler)
        self.emulator = SpeedEmulator(self.speed)
        self.sync = BucketedAllReduce(
            self.model,
            bucket_bytes=self.cfg.strategy.bucket_bytes,
            on_bucket_ready=lambda _b: self.emulator.mark(),
            fault_hook=self._fault_hook,
        )
        log.info("worker %d (%s) speed %.2f joined", self.worker_id, self.opts.name, self.speed)

    def _fault_hook(self, step: int, bucket: int) -> None:
        # crash while the step's first bucket is already being reduced (bucket 1 is about to launch)
        crash_bucket = min(1, self.sync.num_buckets - 1)
        if self.opts.crash_at_step is not None and step == self.opts.crash_at_step and bucket == crash_bucket:
            log.error("fault injection: crashing at step %d", step)
            os._exit(17)

    # ------------------------------------------------------------------ membership
    def _await_first_view(self) -> bool:
        return self._recover(after_epoch=0, adopt=False)

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
                    # members of the job's first view all hold the seeded initial model; a worker
                    # joining later holds nothing until a live replica sends it the state
                    self.has_state = bool(reply.get("initial"))
                if self.worker_id not in view.members:
                    return False
                try:
                    self._adopt(view, force_sync=True)
                    return True
                except CollectiveError as exc:
                    log.warning("epoch %d rendezvous failed (%s); waiting for a newer view", view.epoch, exc)
                    after_epoch = view.epoch
                    adopt = True
                    continue
            time.sleep(0.05)
        raise FlotillaError(f"no view containing worker {self.worker_id} within {self.opts.view_wait_s} s")

    def _adopt(self, view: View, *, force_sync: bool) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self.view = view
        self.group = EpochGroup(
            self.store,
            epoch=view.epoch,
            rank=view.rank_of(self.worker_id),
            world_size=view.world_size,
            timeout_s=self.cfg.strategy.step_timeout_s,
        )
        self.sync.bind(self.group)
        self._sync_state(force_sync or bool(view.joined))
        log.info(
            "worker %d adopted view %d (rank %d of %d) at step %d",
            self.worker_id,
            view.epoch,
            self.group.rank,
            view.world_size,
            self.step,
        )

    def _sync_state(self, wanted: bool) -> None:
        """Agree on the most advanced replica and, if anyone needs it, broadcast its state."""
        g = self.group
        mine = float(self.step if self.has_state else -1)
        probe = torch.tensor([float(wanted), mine, -mine], dtype=torch.float64)
        g.allreduce(probe, op="max")
        need, max_step, min_step = bool(probe[0]), probe[1].item(), -probe[2].item()
        if max_step < 0:
            raise FlotillaError(
                f"view {self.view.epoch}: no live replica holds the model state "
                "(every worker that had it is gone)"
            )
        if not need and max_step == min_step:
            return
        holder = torch.tensor([float(g.rank if self.has_state and mine == max_step else g.world_size)])
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
            try:
                decision = self._one_step()
            except CollectiveError as exc:
                log.warning("step %d discarded: %s", self.step, exc)
                self._record_discarded(str(exc))
                if not self._recover(after_epoch=self.view.epoch, adopt=True):
                    return 0
                continue
            if decision.stop:
                return 0
            if decision.pending_epoch > self.view.epoch:
                try:
                    if not self._transition(decision.pending_epoch):
                        log.info("worker %d left at step %d", self.worker_id, self.step)
                        return 0
                except (CollectiveError, CommError) as exc:
                    log.warning("transition failed: %s", exc)
                    if not self._recover(after_epoch=self.view.epoch, adopt=True):
                        return 0
        self._finish()
        return 0

    def _one_step(self):
        g = self.group
        idx = self.sampler.shard(self.step, g.rank, g.world_size)
        x, y = self.x_train[idx], self.y_train[idx]
        gbatch = len(self.sampler.global_batch(self.step))
        t0 = time.perf_counter()
        res = run_step(
            self.model,
            self.optimizer,
            self.sync,
            x,
            y,
            step=self.step,
            global_batch=gbatch,
            emulator=self.emulator,
            pending_epoch=self._pending_epoch(),
            stop=self.link.stop_requested,
        )
        step_s = time.perf_counter() - t0
        self._record(res, step_s)
        if res.decision.committed or self.cfg.strategy.on_abort == "drop":
            self.step += 1
            if (
                self.group.rank == 0
                and self.cfg.job.eval_every_steps
                and self.step % self.cfg.job.eval_every_steps == 0
                and self.step < self.total_steps
            ):
                self._evaluate_and_record()
        return res.decision

    def _record(self, res, step_s: float) -> None:
        """Send this step's metrics record.  With ``report.metrics_every_steps`` N > 1, committed
        steps are recorded every Nth step, and at the last step, a stop or a membership change;
        a record's ``samples``/``interval_s`` then also count the committed steps held since the
        previous record, so sums over records count every committed sample.  A step that did not
        commit is always recorded, with its own samples only: the held ones wait for the next
        committed record, unless the worker stops here."""
        every = self.cfg.report.metrics_every_steps
        d = res.decision
        flush = d.stop or (
            d.committed and (self.step >= self.total_steps - 1 or d.pending_epoch > self.view.epoch)
        )
        held = (0, 0.0)
        if d.committed or d.stop:
            held, self._unrecorded = self._unrecorded, (0, 0.0)
        samples, interval_s = held[0] + res.num_samples, held[1] + step_s
        if d.committed and self.step % every and not flush:
            self._unrecorded = (samples, interval_s)
            return
        rec = {
            "time_s": time.time() - self.t0_unix,
            "step": self.step,
            "loss": res.loss,
            "samples": samples,
            "interval_s": interval_s,
            "epoch": self.sampler.data_epoch(self.step),
            "membership_epoch": self.view.epoch,
            "rank": self.group.rank,
            "world_size": self.group.world_size,
            "committed": res.decision.committed,
            "speed": self.speed,
            "compute_s": res.compute_s,
            "emulated_s": res.emulated_s,
            "step_s": step_s,
            "samples_per_s": res.num_samples / step_s if step_s > 0 else 0.0,
            "pid": os.getpid(),
        }
        d_every = self.cfg.report.digest_every_steps
        if d_every and res.decision.committed and (self.step + 1) % d_every == 0:
            rec["digest"] = model_digest(self.model)
        self.link.record(rec)

    def _record_discarded(self, why: str) -> None:
        self.link.record(
            {
                "time_s": time.time() - self.t0_unix,
                "step": self.step,
                "loss": float("nan"),
                "samples": 0,
                "epoch": self.sampler.data_epoch(self.step),
                "membership_epoch": self.view.epoch,
                "committed": False,
                "discarded": why[:200],
                "pid": os.getpid(),
                "speed": self.speed,
                "samples_per_s": 0.0,
            }
        )

    def _evaluate_and_record(self) -> dict:
        ev = builders.evaluate(self.model, self.x_test, self.y_test)
        self.link.record(
            {
                "kind": "eval",
                "step": self.step,
                "time_s": time.time() - self.t0_unix,
                "test_accuracy": ev["accuracy"],
                "test_loss": ev["loss"],
            }
        )
        return ev

    def _finish(self) -> None:
        if self.group.rank != 0:
            return
        ev = self._evaluate_and_record()
        self.link.flush()
        self.link.call(
            "finish",
            {
                "worker_id": self.worker_id,
                "result": {
                    "test_accuracy": ev["accuracy"],
                    "test_loss": ev["loss"],
                    "steps": self.step,
                    "digest": model_digest(self.model),
                },
            },
        )

    def _shutdown(self) -> None:
        try:
            self.link.flush(timeout_s=2.0)
        except Exception:
            pass
        if self.group is not None:
            self.group.close()
        self.link.close()
