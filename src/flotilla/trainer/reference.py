"""The single-process reference: the naive training a distributed run is checked against.

``train_single_process(cfg)`` trains the configured model in one process, one thread, on whole
minibatches, with the same data order (``pipeline_setup.make_sampler``: seed, full batches), the
same initial weights (the model seed) and the same optimizer as a pipeline job.  A flushed
pipeline schedule (GPipe, 1F1B) must reproduce its per-step losses; the multi-process tests use it
as their oracle.  It is deliberately simple: no microbatches, no communication, no emulation.
"""

from __future__ import annotations

import torch

from flotilla.config import RunConfig
from flotilla.trainer import builders
from flotilla.trainer.pipeline_setup import make_sampler
from flotilla.trainer.step import cross_entropy

__all__ = ["train_single_process"]


def train_single_process(cfg: RunConfig, num_steps: int | None = None) -> list[float]:
    """Train for ``num_steps`` (default: the job's step count); returns every step's training loss."""
    torch.set_num_threads(1)
    data = builders.build_dataset(cfg)
    x, y = data.train_tensors()
    model = builders.build_model_for(cfg, data)
    opt = builders.build_optimizer(cfg, model)
    sampler = make_sampler(cfg, int(x.shape[0]))
    steps = num_steps if num_steps is not None else builders.total_steps(cfg, sampler)
    losses = []
    for k in range(steps):
        idx = torch.from_numpy(sampler.global_batch(k))
        opt.zero_grad(set_to_none=True)
        loss = cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses
