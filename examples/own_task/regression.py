"""A regression task in its own file: an MLP fitting a smooth function of 8 inputs (MSE loss).

No classes and no accuracy: the task reports ``mse`` per batch, derives ``rmse`` from the
evaluation means (``summarize``), and declares RMSE its headline metric (lower is better), so the
live line, ``summary.json``, ``evals.jsonl`` and the plots show ``test_rmse`` and no accuracy.
The data are generated from a seed (nothing is downloaded); targets have shape ``(N, 1)``, the
model's output shape, so ``mse_loss`` never broadcasts.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import flotilla


def make_data(num_samples: int, num_inputs: int, noise: float, seed: int) -> tuple[torch.Tensor, ...]:
    """``y = sin(2 x0) + x1 x2 + 0.5 cos(x3 + x4) + noise``, standardised to unit variance."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, num_inputs, generator=g)
    y = torch.sin(2 * x[:, 0]) + x[:, 1] * x[:, 2] + 0.5 * torch.cos(x[:, 3] + x[:, 4])
    y = y + noise * torch.randn(num_samples, generator=g)
    return x, ((y - y.mean()) / y.std()).unsqueeze(1)


class Regression(flotilla.Task):
    """``task_args``: num_samples, num_inputs (>= 5), width, noise, seed."""

    headline = ("rmse", "min")  # what reports show first: test RMSE, lower is better
    target = ("rmse", 0.35, "min")

    def __init__(
        self, num_samples: int = 5000, num_inputs: int = 8, width: int = 64, noise: float = 0.1, seed: int = 0
    ) -> None:
        self.num_inputs, self.width = num_inputs, width
        x, y = make_data(num_samples, num_inputs, noise, seed)
        cut = int(0.8 * num_samples)
        self.train, self.test = (x[:cut], y[:cut]), (x[cut:], y[cut:])

    def build_model(self) -> nn.Sequential:
        w = self.width
        layers = [nn.Linear(self.num_inputs, w), nn.GELU(), nn.Linear(w, w), nn.GELU(), nn.Linear(w, 1)]
        return nn.Sequential(*layers)

    def train_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.train

    def eval_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.test

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        return {"mse": float(nn.functional.mse_loss(output, target))}

    def summarize(self, means: dict[str, float]) -> dict[str, float]:
        return {"rmse": math.sqrt(means["mse"])}  # of the mean squared error, not a mean of batch RMSEs
