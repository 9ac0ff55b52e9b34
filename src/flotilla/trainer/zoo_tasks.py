"""The built-in examples as ordinary tasks: a zoo model on a generated or shipped data set.

``ZooTask(model=..., dataset=...)`` is what ``job: {model: {...}, dataset: {...}}`` in a run file
means: the zoo is reached through the same :class:`~flotilla.trainer.task.Task` interface as a
user's own task, so no strategy knows zoo names.  Models come from :mod:`flotilla.models` (built
deterministically from the seed); data from :mod:`flotilla.data` (generated offline and cached).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property

import torch
from torch import nn

from flotilla.data import load_dataset
from flotilla.data.datasets import ArrayDataset
from flotilla.models import build_model
from flotilla.trainer.task import ClassificationTask, perplexity

ZOO_TASK = "flotilla.trainer.zoo_tasks:ZooTask"
LANGUAGE_MODELS = frozenset({"char_transformer"})


class ZooTask(ClassificationTask):
    """Zoo model ``model`` (``cnn1d``, ``mlp``, ``tiny_mlp``, ``char_transformer``) on data set
    ``dataset`` (``mnist1d``, ``synthetic``, ``pysource``)."""

    def __init__(
        self,
        *,
        model: str,
        dataset: str,
        width: int | None = None,
        num_samples: int = 4000,
        test_fraction: float = 0.2,
        seed: int = 0,
    ) -> None:
        self.model_name, self.dataset_name, self.width = model, dataset, width
        self.num_samples, self.test_fraction, self.seed = num_samples, test_fraction, seed
        self._lm = model in LANGUAGE_MODELS

    @cached_property
    def data(self) -> ArrayDataset:
        return load_dataset(self.dataset_name, num_samples=self.num_samples, test_fraction=self.test_fraction)

    def build_model(self) -> nn.Module:
        return build_model(
            self.model_name,
            input_shape=tuple(self.data.x_train.shape[1:]),
            num_classes=self.data.num_classes,
            width=self.width,
            seed=self.seed,
        )

    def train_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data.train_tensors()

    def eval_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data.test_tensors()

    def summarize(self, means: Mapping[str, float]) -> dict[str, float]:
        return {"perplexity": perplexity(means)} if self._lm else {}
