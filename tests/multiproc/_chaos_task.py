"""The chaos test's task (``tests/multiproc/test_chaos.py``): a tiny MLP on a synthetic, separable
data set whose every training forward lasts at least ``pace_s`` -- a stand-in for a real model's
compute.  The pace makes a step's wall time (nearly) independent of the machine, so a job of N
steps outlasts a revocation schedule of T seconds on a fast machine as on a slow one."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn


class _Paced(nn.Module):
    def __init__(self, inner: nn.Module, pace_s: float) -> None:
        super().__init__()
        self.inner, self.pace_s = inner, pace_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self.inner(x)
        if self.training:
            time.sleep(max(0.0, self.pace_s - (time.perf_counter() - start)))
        return out


class PacedMLP:
    """``num_samples`` points in 8 dimensions, 2 classes; a 8-16-2 MLP paced at ``pace_s``."""

    def __init__(self, pace_s: float = 0.05, num_samples: int = 1000) -> None:
        self.pace_s, self.num_samples = pace_s, num_samples

    def _data(self, seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 8, generator=gen)
        return x, (x[:, 0] + x[:, 1] > 0).long()

    def build_model(self) -> nn.Module:
        return _Paced(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), self.pace_s)

    def train_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._data(1, self.num_samples)

    def eval_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._data(2, 200)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        return {"accuracy": float((output.argmax(1) == target).float().mean())}
