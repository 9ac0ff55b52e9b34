"""The worker role for strategy ``ps``: data parallelism through the sharded parameter server.

Per clock ``c`` (a step; under WSP a wave of ``s_local + 1`` steps) the worker computes on its
slice of that step's global batch, pushes its update tagged ``c`` and pulls the global weights for
``c + 1``; the pull blocks as the consistency model (BSP / ASP / SSP / WSP) requires.  Membership
is fixed for the job (the servers' gates count ``num_workers`` workers): the worker's data rank is
its rank in the job's first view.  Rank 0 evaluates the global weights every
``job.eval_every_steps`` clocks and, at the end, once every worker has pushed its last clock
(or left), evaluates the final global weights and reports them as the job's result.

The loss is ``sum(CE) / batch_size`` (the configured global batch): the pushes of one clock sum to
the global-batch gradient, and every sample weighs the same, so an epoch's short last batch makes a
proportionally short step.  (Normalising by the short batch's own length, as ``allreduce`` does,
gives 32 samples the weight of 128; after such a step at the very end of a run, SSP/WSP final
accuracies on ``examples/ps_ssp.yaml`` dropped from ~0.95 to 0.87–0.91.)
"""

from __future__ import annotations

import os
import time

from torch import nn

from flotilla.cluster.emulation import SpeedEmulator
from flotilla.cluster.membership import View
from flotilla.config import RunConfig, validate_config
from flotilla.core.errors import FlotillaError
from flotilla.core.log import get_logger
from flotilla.core.threads import use_torch_threads
from flotilla.roles.link import CoordinatorLink
from flotilla.sync.via_ps import PSSync
from flotilla.trainer import builders

log = get_logger("ps_worker")


class PSWorker:
    def __init__(
        self,
        coordinator: str,
        secret: bytes,
        *,
        name: str | None,
        speed: float | None = None,
        view_wait_s: float = 120.0,
    ) -> None:
        self.name = name
        self.secret = secret
        self.requested_speed = speed
        self.view_wait_s = view_wait_s
        self.link = CoordinatorLink(coordinator, secret, sender=f"psworker-{name or os.getpid()}")

    def run(self) -> int:
        try:
            self._setup()
            view = self._await_view()
            if view is None:
                return 0
            return self._train(view)
        finally:
            try:
                self.link.flush(timeout_s=2.0)
            except Exception:
                pass
            self.link.close()

    def _setup(self) -> None:
        reply = self.link.call("join", {"name": self.name, "speed": self.requested_speed, "pid": os.getpid()})
        self.worker_id = int(reply["worker_id"])
        self.cfg: RunConfig = validate_config(reply["config"])
        self.servers = list(reply.get("ps_servers") or [])
        if len(self.servers) != self.cfg.strategy.num_servers:
            raise FlotillaError(
                f"coordinator lists {len(self.servers)} parameter servers, "
                f"strategy.num_servers is {self.cfg.strategy.num_servers}"
            )
        self.t0_unix, self.speed = float(reply["t0_unix"]), float(reply["speed"])
        self.link.start_heartbeat(self.worker_id)
        use_torch_threads()
        self.data = builders.build_dataset(self.cfg)
        self.x_train, self.y_train = self.data.train_tensors()
        self.x_test, self.y_test = self.data.test_tensors()
        self.model = builders.build_model_for(self.cfg, self.data)
        self.sampler = builders.build_sampler(self.cfg, self.data)
        self.total_steps = builders.total_steps(self.cfg, self.sampler)
        self.emulator = SpeedEmulator(self.speed)

    def _await_view(self) -> View | None:
        deadline = time.monotonic() + self.view_wait_s
        while time.monotonic() < deadline:
            reply = self.link.call(
                "poll_view", {"worker_id": self.worker_id, "after_epoch": 0, "adopt": False}
            )
            if reply["status"] in ("done", "removed"):
                return None
            if reply["status"] == "view":
                if not reply.get("initial"):
                    raise FlotillaError(
                        "strategy ps has a fixed membership: this worker joined after the job started"
                    )
                return View.from_dict(reply["view"])
            time.sleep(0.05)
        raise FlotillaError(f"no view within {self.view_wait_s} s")

    def _train(self, view: View) -> int:
        rank, world = view.rank_of(self.worker_id), view.world_size
        sync = PSSync(
            self.model,
            self.cfg.job.optimizer,
            self.cfg.strategy,
            self.servers,
            self.secret,
            rank,
            num_workers=world,
        )
        try:
            sync.initialize()
            step, clock = 0, 0
            while step < self.total_steps:
                if self.link.stop_requested:  # Ctrl-C or a failed job: leave the PS now
                    log.info("stop requested by the coordinator at clock %d", clock)
                    return 0
                t0 = time.perf_counter()
                loss, samples, compute_s = 0.0, 0, 0.0
                for i in range(sync.wave_size):
                    if step >= self.total_steps:
                        break
                    l, n, c = self._compute(step, rank, world)
                    loss, samples, compute_s = loss + l * n, samples + n, compute_s + c
                    step += 1
                    if i < sync.wave_size - 1 and step < self.total_steps:
                        sync.local_step()
                t_wait = time.perf_counter()
                pulled = sync.push_pull(clock)  # push clock c, pull the weights for c + 1
                wait_s = time.perf_counter() - t_wait
                self._record(
                    step - 1,
                    clock,
                    view,
                    loss / max(1, samples),
                    samples,
                    compute_s,
                    wait_s,
                    time.perf_counter() - t0,
                    pulled,
                    sync.read_c_global,
                )
                clock += 1
                every = self.cfg.job.eval_every_steps
                if rank == 0 and every and clock % every == 0 and step < self.total_steps:
                    sync.refresh(clock)  # evaluate the global weights, not the cache
                    self._evaluate(step)
            if rank == 0 and sync.pull_final(clock, stop=lambda: self.link.stop_requested):
                self._finish(step)  # the result: the global weights once all pushed
        finally:
            sync.close()
        return 0

    def _compute(self, step: int, rank: int, world: int) -> tuple[float, int, float]:
        idx = self.sampler.shard(step, rank, world)
        x, y = self.x_train[idx], self.y_train[idx]
        gbatch = self.sampler.global_batch_size  # nominal: a short last batch = a short step
        self.emulator.reset_counters()
        self.emulator.start()
        if len(idx):
            loss_sum = nn.functional.cross_entropy(self.model(x), y, reduction="sum")
            (loss_sum / gbatch).backward()
            loss = loss_sum.item() / len(idx)
        else:
            loss = float("nan")
        self.emulator.mark()
        compute_s, _ = self.emulator.reset_counters()
        return loss, len(idx), compute_s

    def _record(
        self,
        step: int,
        clock: int,
        view: View,
        loss: float,
        samples: int,
        compute_s: float,
        wait_s: float,
        step_s: float,
        pulled: bool,
        read_c_global: int,
    ) -> None:
        self.link.record(
            {
                "time_s": time.time() - self.t0_unix,
                "step": step,
                "clock": clock,
                "loss": loss,
                "samples": samples,
                "epoch": self.sampler.data_epoch(step),
                "membership_epoch": view.epoch,
                "committed": True,
                "speed": self.speed,
                "compute_s": compute_s,
                "pull_wait_s": wait_s,
                "step_s": step_s,
                "samples_per_s": samples / step_s if step_s > 0 else 0.0,
                "pulled": pulled,
                "read_c_global": read_c_global,
                "pid": os.getpid(),
            }
        )

    def _evaluate(self, step: int) -> dict:
        """Test metrics of the global weights this worker pulled last."""
        ev = builders.evaluate(self.model, self.x_test, self.y_test)
        self.link.record(
            {
                "kind": "eval",
                "step": step,
                "time_s": time.time() - self.t0_unix,
                "test_accuracy": ev["accuracy"],
                "test_loss": ev["loss"],
            }
        )
        return ev

    def _finish(self, step: int) -> None:
        ev = self._evaluate(step)
        self.link.flush()
        self.link.call(
            "finish",
            {
                "worker_id": self.worker_id,
                "result": {"test_accuracy": ev["accuracy"], "test_loss": ev["loss"], "steps": step},
            },
        )
