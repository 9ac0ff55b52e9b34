"""The replica engine: one unit of work is the forward/backward of whole minibatches of the
job's task on a full model replica, then the strategy's synchronisation (``trainer/step.py``).

Each minibatch of the unit is this worker's shard of the global batch of that step (the
global-batch sampler is a pure function of the step, so a redone or resumed step sees exactly the
same samples).  Randomness (dropout, random augmentation in the model) is seeded per unit from
``(job.seed, step, rank)`` (:func:`unit_seed`, CPU and CUDA generators alike): a redone, resumed or
replayed unit draws exactly the same numbers on every rank, so a resume is bitwise equal to an
uninterrupted run with dropout and an uneven split of the batch, and no RNG state has to travel
in checkpoints or state transfers.  The state the members of a view agree on is the model's
``state_dict``, the optimizer state, the learning-rate schedule's position and the step
(``sync/state.py``), and under ``job.precision: fp16`` the loss scale and its count of good units
(``sync/scaler.py``: in ``extra``; a strategy that agrees on the scale also carries it in its own
state, which checkpoints keep).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flotilla.cluster.emulation import SpeedEmulator
from flotilla.comm.collective import Group
from flotilla.data.sampler import GlobalBatchSampler
from flotilla.data.tree import to_device
from flotilla.sync.base import Proposal, SyncStrategy, Terms, terms_of
from flotilla.sync.loss_scale import ScaleState
from flotilla.sync.scaler import LossScaler, agrees_loss_scale
from flotilla.sync.state import average_weights, export_state, import_state, model_digest
from flotilla.trainer.optim import OptimizerBundle, restore_scheduler, scheduler_state
from flotilla.trainer.parts import UnitWhere
from flotilla.trainer.precision import Autocast
from flotilla.trainer.step import Minibatch, StepResult, TaskLoss, run_unit

__all__ = ["ReplicaEngine", "attach_scaler", "unit_seed"]


def unit_seed(seed: int, step: int, rank: int) -> int:
    """The torch seed of the unit starting at ``step`` on ``rank`` (a 63-bit mix of the three)."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + rank * 0x94D049BB133111EB) % 2**64
    x ^= x >> 31
    return x % 2**63


@dataclass(kw_only=True)
class ReplicaEngine:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    train_data: Any  # TaskData: batch(indices) -> (x, y)
    sampler: GlobalBatchSampler
    loss_fn: TaskLoss
    emulator: SpeedEmulator
    device: torch.device
    scheduler: Any = None  # torch LR scheduler, stepped after every committed unit
    seed: int = 0  # job.seed: with the step and the rank, seeds every unit's randomness
    accumulate: int = 1  # job.accumulate: forward/backward passes per minibatch
    autocast: Autocast = nullcontext  # job.precision (trainer/precision.py)
    scaler: LossScaler | None = None  # job.precision fp16: this replica's loss scale
    step: int = 0
    has_state: bool = False
    _unit_steps: int = 1
    _terms: tuple[SyncStrategy, Terms] | None = None  # (read once per strategy, not per unit)

    def run_unit(self, where: UnitWhere, strategy: SyncStrategy, proposal: Proposal) -> StepResult:
        rank, world = where.data_split
        seed = unit_seed(self.seed, where.first_step, rank)
        torch.default_generator.manual_seed(seed)  # (torch.manual_seed costs 100x: dynamo's wrapper)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        self._unit_steps = where.last_step - where.first_step + 1
        batches = []
        for s in range(where.first_step, where.last_step + 1):
            x, y = self.train_data.batch(self.sampler.shard(s, rank, world))
            batches.append(Minibatch(s, to_device(x, self.device), to_device(y, self.device)))
        if self._terms is None or self._terms[0] is not strategy:
            self._terms = (strategy, terms_of(strategy))
            attach_scaler(strategy, self.scaler)
        terms = self._terms[1]
        gbatch = self.sampler.global_batch_size
        if not terms.nominal_batch:
            gbatch = self.sampler.batch_len(where.first_step)
        return run_unit(
            self.model,
            strategy,
            batches,
            global_batch=gbatch,
            emulator=self.emulator,
            proposal=proposal,
            loss_fn=self.loss_fn,
            check_gradients=not terms.checks_gradients,
            accumulate=self.accumulate,
            autocast=self.autocast,
            scaler=self.scaler,
        )

    def after_commit(self) -> None:
        """The schedule moves once per step of the committed unit (several under WSP)."""
        if self.scheduler is not None:
            for _ in range(self._unit_steps):
                self.scheduler.step()

    def export_state(self) -> tuple[dict[str, Any], list[Any]]:
        extra: dict[str, Any] = {"step": self.step}
        if self.scheduler is not None:
            extra["scheduler"] = scheduler_state(self.scheduler)
        if self.scaler is not None:
            extra["loss_scale"] = self.scaler.state_dict()
        return export_state(self.model, self.optimizer, extra)

    def import_state(self, meta: dict[str, Any], tensors: list[Any]) -> None:
        extra = import_state(self.model, self.optimizer, meta, tensors)
        self.step = int(extra["step"])
        if self.scheduler is not None:
            restore_scheduler(OptimizerBundle(self.optimizer, self.scheduler), extra.get("scheduler"))
        if self.scaler is not None and extra.get("loss_scale") is not None:
            self.scaler.load_state_dict(extra["loss_scale"])

    def digest(self) -> str:
        return model_digest(self.model)

    def average(self, group: Group) -> None:
        """The replicas' mean weights; fp16: every member takes the smallest scale among them
        (replicas that each kept their own scale switch into a strategy that agrees on one)."""
        average_weights(group, self.model)
        if self.scaler is not None:
            device = next(self.model.parameters()).device  # (an NCCL group reduces device tensors)
            neg = torch.tensor([-self.scaler.scale], dtype=torch.float64, device=device)
            group.allreduce(neg, op="max")
            self.scaler.state = ScaleState(scale=-float(neg.item()), good_units=0)


def attach_scaler(strategy: SyncStrategy, scaler: LossScaler | None) -> None:
    """Give ``scaler`` to a strategy that settles it from its agreed verdict (``use_loss_scale``);
    the others' steps settle it in ``trainer/step.py``."""
    if scaler is not None and agrees_loss_scale(strategy):
        strategy.use_loss_scale(scaler)  # type: ignore[attr-defined]
