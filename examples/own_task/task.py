"""A user task in its own file: a small residual MLP with LayerNorm on generated 2-D spirals.

Nothing here comes from flotilla's zoo: the model, the data set (a map-style ``Dataset``
generated from a seed, no download) and the metric are the user's.  flotilla only needs the five
methods of its task interface (``docs/tasks.md``); every worker, stage and server process builds
this class from its name ``examples/own_task/task.py:Spirals`` and the ``task_args``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import Dataset

import flotilla


class SpiralDataset(Dataset):
    """``num_arms`` interleaved noisy spirals in the plane; the label is the arm."""

    def __init__(self, num_samples: int, num_arms: int, noise: float, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, num_arms, (num_samples,), generator=g)
        radius = torch.rand(num_samples, generator=g) * 0.9 + 0.1
        angle = labels * (2 * math.pi / num_arms) + radius * 3.0 * math.pi
        angle = angle + noise * torch.randn(num_samples, generator=g)
        self.x = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
        self.y = labels

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class Residual(nn.Module):
    """``x + MLP(LayerNorm(x))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Spirals(flotilla.Task):
    """The task: classify spiral arms (subclassing flotilla.Task is optional: it records the
    keyword arguments, so `flotilla.run(cfg, task=Spirals(width=64))` can rebuild it elsewhere).

    ``task_args``: width, depth, num_samples, num_arms, noise, seed."""

    target = ("accuracy", 0.9, "max")

    def __init__(
        self,
        width: int = 64,
        depth: int = 3,
        num_samples: int = 6000,
        num_arms: int = 3,
        noise: float = 0.15,
        seed: int = 0,
    ) -> None:
        self.width, self.depth, self.num_arms = width, depth, num_arms
        full = SpiralDataset(num_samples, num_arms, noise, seed)
        cut = int(0.8 * num_samples)
        self.train = torch.utils.data.Subset(full, range(cut))
        self.test = torch.utils.data.Subset(full, range(cut, num_samples))

    def build_model(self) -> nn.Sequential:
        blocks = [Residual(self.width) for _ in range(self.depth)]
        return nn.Sequential(
            nn.Linear(2, self.width), *blocks, nn.LayerNorm(self.width), nn.Linear(self.width, self.num_arms)
        )

    def train_data(self) -> Dataset:
        return self.train

    def eval_data(self) -> Dataset:
        return self.test

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        return {"accuracy": float((output.argmax(dim=1) == target).float().mean())}
