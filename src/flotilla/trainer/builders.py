"""Builders: turn a validated :class:`~flotilla.config.RunConfig` into data, model and optimizer.

Every worker builds the same model from the same seed, so replicas start identical even before
the first state broadcast; the data set is generated once and cached (see ``flotilla.data``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flotilla.config import RunConfig
from flotilla.data import load_dataset
from flotilla.data.datasets import ArrayDataset
from flotilla.data.sampler import GlobalBatchSampler
from flotilla.models import build_model


def build_dataset(cfg: RunConfig) -> ArrayDataset:
    ds = cfg.job.dataset
    return load_dataset(ds.name, num_samples=ds.num_samples, test_fraction=ds.test_fraction)


def build_model_for(cfg: RunConfig, data: ArrayDataset) -> nn.Module:
    m = cfg.job.model
    return build_model(
        m.name,
        input_shape=tuple(data.x_train.shape[1:]),
        num_classes=data.num_classes,
        width=m.width,
        seed=cfg.job.seed,
    )


def build_optimizer(cfg: RunConfig, model: nn.Module) -> torch.optim.Optimizer:
    o = cfg.job.optimizer
    if o.kind == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, nesterov=o.nesterov
        )
    if o.kind == "adam":
        return torch.optim.Adam(
            model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
        )
    raise ValueError(f"job.optimizer.kind: unknown {o.kind!r}; allowed: sgd, adam")


def build_sampler(cfg: RunConfig, data: ArrayDataset) -> GlobalBatchSampler:
    return GlobalBatchSampler(
        num_samples=int(data.x_train.shape[0]), global_batch_size=cfg.job.batch_size, seed=cfg.job.seed
    )


def total_steps(cfg: RunConfig, sampler: GlobalBatchSampler) -> int:
    if cfg.job.steps is not None:
        return cfg.job.steps
    return int(cfg.job.epochs) * sampler.steps_per_epoch


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 2048) -> dict[str, float]:
    """Accuracy and mean loss on a held-out split."""
    was_training = model.training
    model.eval()
    correct, loss_sum = 0, 0.0
    for i in range(0, int(y.shape[0]), batch):
        out = model(x[i : i + batch])
        loss_sum += nn.functional.cross_entropy(out, y[i : i + batch], reduction="sum").item()
        correct += int((out.argmax(dim=1) == y[i : i + batch]).sum())
    model.train(was_training)
    n = max(1, int(y.shape[0]))
    return {"accuracy": correct / n, "loss": loss_sum / n if n else math.nan}
