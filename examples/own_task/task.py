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


class BNSpirals(Spirals):
    """The same task with BatchNorm between the layers (buffers the forward pass updates: under
    ``allreduce`` the replicas' running statistics are averaged at every step, docs/tasks.md)."""

    def build_model(self) -> nn.Sequential:
        w = self.width
        return nn.Sequential(
            nn.Linear(2, w), nn.BatchNorm1d(w), nn.ReLU(), nn.Linear(w, w), nn.BatchNorm1d(w), nn.ReLU(),
            nn.Linear(w, self.num_arms),
        )  # fmt: skip


class TiedLM(flotilla.Task):
    """A tiny language model whose output layer shares its weight with the embedding: predict the
    next token of arithmetic sequences mod ``vocab``.  Under a pipeline the embedding and the
    output layer land on different stages, which keep the tie (docs/pipeline.md).

    ``task_args``: vocab, seq_len, dim, num_samples, seed."""

    target = ("accuracy", 0.9, "max")

    def __init__(
        self, vocab: int = 16, seq_len: int = 12, dim: int = 32, num_samples: int = 4000, seed: int = 0
    ):
        self.vocab, self.dim = vocab, dim
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (num_samples, 1), generator=g)
        stride = torch.randint(1, 4, (num_samples, 1), generator=g)
        ids = (start + stride * torch.arange(seq_len + 1)) % vocab
        cut = int(0.8 * num_samples)
        self.train = (ids[:cut, :-1], ids[:cut, 1:])
        self.test = (ids[cut:, :-1], ids[cut:, 1:])

    def build_model(self) -> nn.Sequential:
        d = self.dim
        model = nn.Sequential(
            nn.Embedding(self.vocab, d),
            WithPrevious(),  # (parameter-free: each position also sees the token before it)
            nn.Linear(2 * d, d),
            nn.Tanh(),
            nn.Linear(d, self.vocab, bias=False),
        )
        model[4].weight = model[0].weight  # tied: the output layer IS the embedding
        return model

    def train_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.train

    def eval_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.test

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output.reshape(-1, self.vocab), target.reshape(-1))

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        return {"accuracy": float((output.argmax(dim=-1) == target).float().mean())}


class WithPrevious(nn.Module):
    """``(N, T, D) -> (N, T, 2D)``: each position's vector next to the previous position's (zeros
    at the first)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
        return torch.cat([h, prev], dim=-1)
