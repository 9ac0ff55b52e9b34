"""The ``job`` section: model, data set, optimizer, batch size and length of the run."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from flotilla.config.base import _fail, _Model


class ModelConfig(_Model):
    """Which model to train; ``width`` overrides its hidden size."""

    name: Literal["cnn1d", "mlp", "tiny_mlp", "char_transformer"]
    width: int | None = Field(default=None, gt=0, le=65536)


class DatasetConfig(_Model):
    """Which data set; ``synthetic`` is a generated linearly separable set for fast tests."""

    name: Literal["mnist1d", "synthetic", "pysource"]
    num_samples: int = Field(default=4000, ge=10, le=10**9)
    test_fraction: float = Field(default=0.2, gt=0, lt=1)

    @model_validator(mode="after")
    def _check(self) -> DatasetConfig:
        # The data layer owns the exact split; this only refuses an empty side.
        num_train = int(self.num_samples * (1.0 - self.test_fraction))
        if not 1 <= num_train < self.num_samples:
            raise _fail(
                f"leaves {num_train} of {self.num_samples} samples for training; "
                "train and test must both be non-empty",
                "test_fraction",
            )
        return self


class SGDOptimizer(_Model):
    """``torch.optim.SGD``."""

    kind: Literal["sgd"] = "sgd"
    lr: float = Field(default=0.05, gt=0)
    momentum: float = Field(default=0.9, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)
    nesterov: bool = False

    @model_validator(mode="after")
    def _check(self) -> SGDOptimizer:
        if self.nesterov and self.momentum == 0:
            raise _fail("needs momentum > 0 (got momentum=0)", "nesterov")
        return self


Beta = Annotated[float, Field(gt=0, lt=1)]


class AdamOptimizer(_Model):
    """``torch.optim.Adam``."""

    kind: Literal["adam"] = "adam"
    lr: float = Field(default=1e-3, gt=0)
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)


Optimizer = Annotated[Union[SGDOptimizer, AdamOptimizer], Field(discriminator="kind")]


class JobConfig(_Model):
    """What to train and for how long; ``batch_size`` is the GLOBAL batch of one step."""

    model: ModelConfig
    dataset: DatasetConfig
    optimizer: Optimizer = SGDOptimizer()
    batch_size: int = Field(default=128, ge=1, le=2**24)
    steps: int | None = Field(default=None, ge=1)
    epochs: int | None = Field(default=None, ge=1)
    seed: int = Field(default=0, ge=0, lt=2**63)
    eval_every_steps: int = Field(default=200, ge=0)

    @model_validator(mode="after")
    def _check(self) -> JobConfig:
        if (self.steps is None) == (self.epochs is None):
            got = "neither" if self.steps is None else f"steps={self.steps}, epochs={self.epochs}"
            raise _fail(f"exactly one of steps, epochs must be set (got {got}; set the other to null)")
        return self
