"""The model gallery: tasks built from the layers real models are made of, each small enough to
train in seconds on generated data (nothing downloaded).  Every process of a job builds them from
this file's path, as a user's task file.

- ``BatchNormMLP``: BatchNorm1d between linear layers (buffers the forward pass updates);
- ``FrozenExtractor``: a frozen first block (``requires_grad=False``), a trained head;
- ``ParamFree``: layers without parameters (Flatten, ReLU, Dropout) between linear layers;
- ``TokenLM``: int64 token ids -> embedding -> linear head (int64 inputs and sequence targets);
- ``TiedLM``: the same with the output layer's weight tied to the embedding's;
- ``DictInputs``: inputs are a dict of tensors (``{"a": (N, 2), "b": (N, 3)}``);
- ``AuxOutput``: the model returns ``(logits, aux)``; the loss adds a small penalty on ``aux``.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn
from torch.nn import functional as F

import flotilla


def spirals(num: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (num,), generator=g)
    r = torch.rand(num, generator=g) * 0.9 + 0.1
    a = y * (2 * math.pi / 3) + r * 3.0 * math.pi + 0.1 * torch.randn(num, generator=g)
    return torch.stack([r * torch.cos(a), r * torch.sin(a)], dim=1), y


class _Classify(flotilla.Task):
    """Spirals classification; subclasses build the model."""

    def __init__(self, num_samples: int = 1200, width: int = 32, seed: int = 0) -> None:
        self.width = width
        x, y = spirals(num_samples, seed)
        cut = int(0.8 * num_samples)
        self.train, self.test = (x[:cut], y[:cut]), (x[cut:], y[cut:])

    def train_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.train

    def eval_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.test

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        return {"accuracy": (output.argmax(-1) == target).float().mean().item()}


class BatchNormMLP(_Classify):
    def build_model(self) -> nn.Sequential:
        w = self.width
        return nn.Sequential(
            nn.Linear(2, w), nn.BatchNorm1d(w), nn.ReLU(), nn.Linear(w, w), nn.BatchNorm1d(w), nn.ReLU(),
            nn.Linear(w, 3),
        )  # fmt: skip


class FrozenExtractor(_Classify):
    def build_model(self) -> nn.Sequential:
        w = self.width
        model = nn.Sequential(nn.Linear(2, w), nn.Tanh(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 3))
        for layer in model[:2]:
            for p in layer.parameters():
                p.requires_grad_(False)
        return model


class ParamFree(_Classify):
    def build_model(self) -> nn.Sequential:
        w = self.width
        return nn.Sequential(
            nn.Linear(2, w), nn.ReLU(), nn.Dropout(0.0), nn.Identity(), nn.Flatten(), nn.Linear(w, 3)
        )


class DictInputs(_Classify):
    """Inputs ``{"a": x[:, :1], "b": x[:, 1:]}``; a map-style dataset of ``(dict, label)``."""

    def train_data(self) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        x, y = self.train
        return [({"a": x[i, :1], "b": x[i, 1:]}, y[i]) for i in range(len(y))]

    def eval_data(self) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        x, y = self.test
        return [({"a": x[i, :1], "b": x[i, 1:]}, y[i]) for i in range(len(y))]

    def build_model(self) -> nn.Module:
        return _DictNet(self.width)


class _DictNet(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(1, width), nn.Linear(1, width)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(width, 3))

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(self.a(x["a"]) + self.b(x["b"]))


class AuxOutput(_Classify):
    """The model returns ``(logits, aux)``; the loss is cross-entropy + 0.01 * mean(aux^2)."""

    def build_model(self) -> nn.Module:
        return _AuxNet(self.width)

    def loss(self, output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits, aux = output
        return F.cross_entropy(logits, target) + 0.01 * aux.pow(2).mean()

    def metrics(self, output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> dict[str, float]:  # type: ignore[override]
        return super().metrics(output[0], target)


class _AuxNet(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, width), nn.ReLU())
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.head(h), h.mean(-1)


class TokenLM(flotilla.Task):
    """Predict the next token of a repeating pattern: int64 ids ``(N, T)`` -> logits ``(N, T, V)``."""

    def __init__(
        self, vocab: int = 12, seq: int = 8, num_samples: int = 600, dim: int = 16, seed: int = 0
    ) -> None:
        self.vocab, self.dim = vocab, dim
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (num_samples, 1), generator=g)
        step = torch.randint(1, 3, (num_samples, 1), generator=g)
        ids = (start + step * torch.arange(seq + 1)) % vocab
        cut = int(0.8 * num_samples)
        self.train, self.test = (ids[:cut, :-1], ids[:cut, 1:]), (ids[cut:, :-1], ids[cut:, 1:])

    def build_model(self) -> nn.Sequential:
        return nn.Sequential(nn.Embedding(self.vocab, self.dim), nn.Tanh(), nn.Linear(self.dim, self.vocab))

    def train_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.train

    def eval_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.test

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        return {"accuracy": (output.argmax(-1) == target).float().mean().item()}


class TiedLM(TokenLM):
    """:class:`TokenLM` whose output layer shares its weight with the embedding."""

    def build_model(self) -> nn.Sequential:
        model = super().build_model()
        model[2].weight = model[0].weight
        return model


class _NextId(nn.Module):
    """Parameter-free, integer in and out: ``(ids + 1) % vocab``."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids + 1) % self.vocab


class IntBoundaryLM(TokenLM):
    """:class:`TokenLM` behind a parameter-free integer layer: a pipeline whose first stage holds
    only that layer sends int64 ids across the boundary and has no parameters."""

    def build_model(self) -> nn.Sequential:
        return nn.Sequential(_NextId(self.vocab), *super().build_model())


class _AuxHead(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.head = nn.Linear(width, 3)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(h), h.mean(-1)


class AuxOutputSeq(AuxOutput):
    """:class:`AuxOutput` as an ``nn.Sequential`` whose last layer returns ``(logits, aux)``."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(2, self.width), nn.ReLU(), _AuxHead(self.width))


class _Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


class _First(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return pair[0]


class TupleMiddle(_Classify):
    """A layer in the middle returns a tuple: a pipeline cannot cut there (refused)."""

    def build_model(self) -> nn.Sequential:
        return nn.Sequential(nn.Linear(2, self.width), _Pair(), _First(), nn.Linear(self.width, 3))


class _Boom(nn.Module):
    """Raises on its 6th training call (on the stage that holds it only)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls == 6:
                raise RuntimeError("boom in the last layer")
        return x


class _BoomOnce(nn.Module):
    """Raises on its 6th training call in the one process that first claims ``marker`` (O_EXCL):
    once in the whole job."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.calls, self.marker = 0, marker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls == 6:
                try:
                    os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    return x
                raise RuntimeError("boom once in the last layer")
        return x


class FailsOnceInTheHead(_Classify):
    """The last layer of one stage process in the whole job raises once (``_BoomOnce``)."""

    def __init__(self, marker: str, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.marker = marker

    def build_model(self) -> nn.Sequential:
        head = _BoomOnce(self.marker)
        return nn.Sequential(nn.Linear(2, self.width), nn.ReLU(), nn.Linear(self.width, 3), head)


class FailsInTheHead(_Classify):
    """Its last layer raises after a few microbatches: the launcher must name the last stage."""

    def build_model(self) -> nn.Sequential:
        return nn.Sequential(nn.Linear(2, self.width), nn.ReLU(), nn.Linear(self.width, 3), _Boom())
