"""The user's side of flotilla: a *task* is what a user brings -- a model, data, a loss, metrics.

Every strategy (allreduce, ps, pipeline, and the later ones) trains a :class:`Task`; the built-in
examples are ordinary tasks too (:mod:`flotilla.trainer.zoo_tasks`).  A task class is named in YAML
by an import path (``"my_pkg.tasks:Digits"``) or a file path (``"./my_task.py:Digits"``) with
keyword arguments ``task_args``; every process of a job (workers, stages, servers) builds its own
instance from that name, so the task must be importable there and deterministic: the same
arguments and the same seed give the same data and the same initial model (DESIGN: no pickle
crosses a process boundary, so a task *object* never travels -- its name and arguments do).

Contract (``docs/tasks.md`` has the long form):

- ``build_model()`` returns a fresh ``nn.Module``; pipeline strategies cut an ``nn.Sequential``
  (or a list of modules, wrapped into one) into stages by layer index and trace any other module
  to cut it at named modules (``pipeline/trace.py``).  It is
  called after ``torch.manual_seed(job.seed)`` on every process.
- ``train_data()`` / ``eval_data()`` return a map-style ``torch.utils.data.Dataset`` whose items
  are ``(input, target)`` pairs, or a pair of tensors ``(inputs, targets)`` (first dimension =
  samples).  Indices come from flotilla's global-batch sampler (every sample exactly once per
  data epoch, whatever the membership).
- ``loss(output, target)`` returns the **mean** loss over the batch (a scalar tensor), like
  ``torch.nn.functional.cross_entropy`` with its default reduction.  flotilla rescales it so that
  the gradients of a step sum to the global-batch mean whatever the split across workers.
- ``metrics(output, target)`` returns batch means (e.g. ``{"accuracy": 0.93}``); evaluation
  weighs them by batch size.  ``summarize(means)`` may derive more (e.g. perplexity from the mean
  loss); the evaluation always reports ``loss`` (the task loss) next to the metrics.
- ``headline = (metric, "max" | "min")`` (optional class attribute) names the evaluation result
  reports show first (live line, ``summary.json``, ``evals.jsonl``, plots), e.g. ``("rmse",
  "min")``; by default the ``target``'s metric, else ``accuracy`` when the task has one, else the
  loss (``flotilla.report.headline``).  A malformed declaration fails when the class is defined.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from flotilla.report.headline import declared_headline

DataSource = Dataset[Any] | tuple[torch.Tensor, torch.Tensor]

REQUIRED_METHODS = ("build_model", "train_data", "eval_data", "loss", "metrics")


class Task(ABC):
    """Base class of a user task (subclassing it is optional: any class with the five required
    methods works, see :data:`REQUIRED_METHODS`)."""

    #: the metric a run should reach (name, threshold, "max" or "min"); used by examples and docs
    target: tuple[str, float, str] | None = None
    #: the evaluation result reports show first and its direction, e.g. ("rmse", "min"); None: the
    #: target's metric, else accuracy when the task has one, else the loss (report/headline.py)
    headline: tuple[str, str] | None = None
    #: the keyword arguments this instance was built with (recorded by ``__new__``)
    task_args: dict[str, Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> Task:
        """Record the keyword arguments, so that other processes can rebuild this task by name."""
        if args:
            raise TypeError(
                f"{cls.__name__}: pass task arguments by keyword (they are sent to every process)"
            )
        task = super().__new__(cls)
        task.task_args = dict(kwargs)
        return task

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared_headline(cls)  # a malformed ``headline`` fails here, with one line

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A fresh model (pipelines cut an ``nn.Sequential`` or trace any other module)."""

    @abstractmethod
    def train_data(self) -> DataSource:
        """Training samples: a map-style dataset of ``(input, target)`` or ``(inputs, targets)``."""

    @abstractmethod
    def eval_data(self) -> DataSource:
        """Held-out samples, same forms as :meth:`train_data`."""

    @abstractmethod
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean loss over the batch (scalar tensor)."""

    @abstractmethod
    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        """Batch means of the evaluation metrics."""

    def summarize(self, means: Mapping[str, float]) -> dict[str, float]:
        """Metrics derived from the evaluation means (default: none)."""
        return {}


class ClassificationTask(Task, ABC):
    """A task whose loss is cross-entropy and whose metric is accuracy (the zoo's tasks)."""

    target = ("accuracy", 0.9, "max")
    headline = ("accuracy", "max")

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss summed over the batch's samples (optional hook: exact summation, no
        mean-then-scale): :func:`cross_entropy_sum`."""
        return cross_entropy_sum(output, target)

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        return {"accuracy": float((output.argmax(dim=1) == target).float().mean())}


class LanguageModelTask(ClassificationTask, ABC):
    """Next-token prediction: logits ``(batch, vocab, seq)`` (class dimension 1, as
    ``cross_entropy`` expects); reports per-token accuracy and perplexity = exp(mean loss)."""

    target = ("perplexity", 10.0, "min")
    headline = ("perplexity", "min")

    def summarize(self, means: Mapping[str, float]) -> dict[str, float]:
        return {"perplexity": perplexity(means)}


def cross_entropy_sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the batch's samples, each sample's loss the mean over its
    positions (per-token targets ``[B, T]``: a language model), so that divided by the samples
    it is ``cross_entropy``'s mean, as ``loss`` gives it; one target per sample: the plain sum."""
    if target.dim() <= 1:
        return nn.functional.cross_entropy(output, target, reduction="sum")
    per = nn.functional.cross_entropy(output, target, reduction="none")
    return per.reshape(per.shape[0], -1).mean(dim=1).sum()


def perplexity(means: Mapping[str, float]) -> float:
    """``exp`` of the mean task loss (capped at e^50 so a diverged run reports a finite number)."""
    return math.exp(min(means.get("loss", math.nan), 50.0))


def missing_methods(obj: object) -> list[str]:
    """The required task methods ``obj`` lacks (empty: it is a usable task)."""
    return [name for name in REQUIRED_METHODS if not callable(getattr(obj, name, None))]
