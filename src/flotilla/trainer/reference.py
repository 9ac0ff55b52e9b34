"""The single-process reference: the naive training a distributed run is checked against.

``train_single_process(cfg)`` trains the job's task in one process, one thread, on whole
minibatches, with the same data order (``pipeline_setup.make_sampler``: seed, full batches), the
same initial weights (``builders.build_task_model``: torch seeded with ``job.seed``), the same
loss (the task's batch mean) and the same optimizer as a pipeline job.  A flushed pipeline schedule
(GPipe, 1F1B) must reproduce its per-step losses; the multi-process tests use it as their oracle.
It is deliberately simple: no microbatches, no communication, no emulation.
"""

from __future__ import annotations

import torch
from torch import nn

from flotilla.config import RunConfig
from flotilla.trainer import builders, optim
from flotilla.trainer.pipeline_setup import make_sampler

__all__ = ["train_reference", "train_single_process"]


def train_single_process(cfg: RunConfig, num_steps: int | None = None) -> list[float]:
    """Train for ``num_steps`` (default: the job's step count); returns every step's training loss."""
    return train_reference(cfg, num_steps)[0]


def train_reference(cfg: RunConfig, num_steps: int | None = None) -> tuple[list[float], nn.Module]:
    """:func:`train_single_process`'s losses and the trained model."""
    torch.set_num_threads(1)
    task = builders.build_task(cfg)
    model = builders.build_task_model(cfg, task)
    train, _ = builders.build_task_data(task)
    sampler = make_sampler(cfg, train.num_samples)
    steps = num_steps if num_steps is not None else builders.total_steps(cfg, sampler)
    bundle = optim.build_optimizer(cfg, model, task, total_steps=builders.total_steps(cfg, sampler))
    opt = bundle.optimizer
    losses = []
    for k in range(steps):
        x, y = train.batch(sampler.global_batch(k))
        opt.zero_grad(set_to_none=True)
        loss = task.loss(model(x), y)
        loss.backward()
        opt.step()
        if bundle.scheduler is not None:
            bundle.scheduler.step()
        losses.append(float(loss.detach()))
    return losses, model
