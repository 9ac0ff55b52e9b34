"""The ``job`` section: the task (a user task by name, or a zoo model + data set), optimizer,
learning-rate schedule, batch size and length of the run.

``optimizer`` and ``schedule`` are tagged on ``kind``: ``{kind: sgd | adam | adamw, lr: ...}`` (every
optimizer also takes ``clip_grad_norm`` and ``weight_decay_on``: :class:`_OptimizerCommon`) and
``{kind: constant}`` (default), ``{kind: linear_warmup, warmup_steps: N}``, ``{kind: cosine,
warmup_steps: N, min_lr: x, decay_steps: T}``; ``trainer/optim.py`` builds them (docs/optimizers.md).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from flotilla.config.base import _fail, _Model
from flotilla.core.errors import ConfigError
from flotilla.ps.lr_schedule import Constant, Cosine, LinearWarmup, LRSchedule


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


class _OptimizerCommon(_Model):
    """Fields of every optimizer kind (docs/optimizers.md).

    ``clip_grad_norm``: clip the gradient to this global L2 norm before every step (the reduced
    gradient under ``allreduce``, each worker's local mean gradient under ``ps`` with ``update:
    delta``, the norm over all stages in a flushing pipeline); None: no clipping.
    ``weight_decay_on``: ``weights`` -- only parameters of two or more dimensions (matrices,
    convolution kernels, embeddings) are decayed, biases and normalisation scales are not;
    ``all`` -- every parameter.  Both are left out of the configuration's dump while they have no
    effect (no clipping; ``weight_decay`` 0), so older configurations keep their fingerprint."""

    weight_decay: float = Field(default=0.0, ge=0)
    clip_grad_norm: float | None = Field(default=None, gt=0)
    weight_decay_on: Literal["weights", "all"] = "weights"

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.clip_grad_norm is None:
            data.pop("clip_grad_norm", None)
        if self.weight_decay == 0:
            data.pop("weight_decay_on", None)
        return data


class SGDOptimizer(_OptimizerCommon):
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


class AdamOptimizer(_OptimizerCommon):
    """``torch.optim.Adam``."""

    kind: Literal["adam"] = "adam"
    lr: float = Field(default=1e-3, gt=0)
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)


class AdamWOptimizer(_OptimizerCommon):
    """``torch.optim.AdamW``: Adam with decoupled weight decay (``w -= lr·weight_decay·w`` per step)."""

    kind: Literal["adamw"] = "adamw"
    lr: float = Field(default=1e-3, gt=0)
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.01, ge=0)


Optimizer = Annotated[Union[SGDOptimizer, AdamOptimizer, AdamWOptimizer], Field(discriminator="kind")]


class ConstantSchedule(_Model):
    """The optimizer's learning rate at every step (the default)."""

    kind: Literal["constant"] = "constant"


class LinearWarmupSchedule(_Model):
    """Linear warmup: step s (from 0) uses ``lr·(s + 1)/warmup_steps`` until ``warmup_steps``, then ``lr``."""

    kind: Literal["linear_warmup"] = "linear_warmup"
    warmup_steps: int = Field(ge=1, le=10**9)


class CosineSchedule(_Model):
    """Linear warmup over ``warmup_steps``, then half a cosine from ``lr`` down to ``min_lr`` at
    ``decay_steps`` (default: the job's total steps), ``min_lr`` after that."""

    kind: Literal["cosine"] = "cosine"
    warmup_steps: int = Field(default=0, ge=0, le=10**9)
    min_lr: float = Field(default=0.0, ge=0)
    decay_steps: int | None = Field(default=None, ge=1, le=10**9)

    @model_validator(mode="after")
    def _check(self) -> CosineSchedule:
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise _fail(
                f"must be > warmup_steps ({self.warmup_steps}) (got {self.decay_steps})", "decay_steps"
            )
        return self


Schedule = Annotated[
    Union[ConstantSchedule, LinearWarmupSchedule, CosineSchedule], Field(discriminator="kind")
]


ZOO_TASK = "flotilla.trainer.zoo_tasks:ZooTask"


class TaskArgs(dict[str, Any]):
    """``job.task_args``: a mapping of plain YAML values, hashable like the rest of the config."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(json.dumps(self, sort_keys=True, default=str))


def _task_args(value: dict[str, Any]) -> TaskArgs:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise _fail(f"must hold plain values (numbers, strings, lists, mappings): {exc}") from None
    return TaskArgs(value)


class JobConfig(_Model):
    """What to train and for how long; ``batch_size`` is the GLOBAL batch of one step.

    The task is either ``task`` (a user task: ``"pkg.module:Class"`` or ``"path/file.py:Class"``,
    built with the keyword arguments ``task_args``; docs/tasks.md) or the zoo's ``model`` and
    ``dataset`` (which mean the task ``flotilla.trainer.zoo_tasks:ZooTask``).
    """

    task: str | None = Field(default=None, min_length=3, max_length=4096)
    task_args: Annotated[dict[str, Any], AfterValidator(_task_args)] = Field(default_factory=TaskArgs)
    model: ModelConfig | None = None
    dataset: DatasetConfig | None = None
    optimizer: Optimizer = SGDOptimizer()
    schedule: Schedule = ConstantSchedule()  # the learning rate over the steps (docs/optimizers.md)
    batch_size: int = Field(default=128, ge=1, le=2**24)
    # gradient accumulation: each worker computes its share of a step's global batch in this many
    # forward/backward passes and synchronises once (the same update as one pass, less memory)
    accumulate: int = Field(default=1, ge=1, le=4096)
    steps: int | None = Field(default=None, ge=1)
    epochs: int | None = Field(default=None, ge=1)
    seed: int = Field(default=0, ge=0, lt=2**63)
    eval_every_steps: int = Field(default=200, ge=0)
    # a step whose loss or gradients are not finite is never applied: stop the job (one line, exit
    # code != 0), or skip such steps and stop after more than max_nonfinite of them
    nonfinite: Literal["stop", "skip"] = "stop"
    max_nonfinite: int = Field(default=10, ge=0, le=10**9)
    # an exception raised while a worker trains (the task's code -- a corrupt record, a bug -- not a
    # lost machine, an out-of-memory or a network error): stop the job at once with that error
    # (another worker given the same batch would raise it too), or lose that worker alone and train
    # on without it (an error of that worker's host: a missing file, a flaky mount)
    on_error: Literal["stop", "lose_worker"] = "stop"
    # without a ``checkpoint`` section the launcher checkpoints by default (pipelines:
    # docs/checkpoints.md); false: no default checkpoints
    auto_checkpoint: bool = True
    # how often a dead role is restarted by the launcher: a pipeline stage (the job restarts from
    # the newest checkpoint; with pipeline replicas, a lost instance comes back this many times
    # per attempt) or a parameter-server shard (from its newest snapshot / its backup)
    max_restarts: int = Field(default=3, ge=0, le=1000)
    # mixed precision (trainer/precision.py, docs/gpu.md): bf16 / fp16 run the forward pass and the
    # loss under torch.autocast in bfloat16 / float16; weights, gradients and optimizer state stay
    # float32; fp16 scales the loss by a dynamic loss scale (not with PipeDream's schedule: no flush)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # torch.compile of the model in place (each stage's layers in a pipeline), with this backend
    compile: bool = False
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"

    @model_validator(mode="after")
    def _check(self) -> JobConfig:
        zoo = (self.model is not None, self.dataset is not None)
        if self.task is not None and any(zoo):
            raise _fail("set either task (your own) or model + dataset (the zoo), not both", "task")
        if self.task is None and not all(zoo):
            missing = "model" if self.model is None else "dataset"
            raise _fail(
                f"set task (your own task) or both model and dataset (the zoo); {missing} is missing", missing
            )
        if self.task is None and self.task_args:
            raise _fail("task_args needs task (the zoo takes model and dataset)", "task_args")
        if self.task is not None and ":" not in self.task:
            raise _fail(
                f"must be 'package.module:Class' or 'path/to/file.py:Class' (got {self.task!r})", "task"
            )
        if (self.steps is None) == (self.epochs is None):
            got = "neither" if self.steps is None else f"steps={self.steps}, epochs={self.epochs}"
            raise _fail(f"exactly one of steps, epochs must be set (got {got}; set the other to null)")
        self._check_schedule()
        return self

    def _check_schedule(self) -> None:
        s = self.schedule
        if isinstance(s, CosineSchedule) and s.min_lr > self.optimizer.lr:
            raise _fail(
                f"must be <= job.optimizer.lr ({self.optimizer.lr:g}) (got {s.min_lr:g})", "schedule.min_lr"
            )
        if isinstance(s, CosineSchedule) and s.decay_steps is None and self.steps is not None:
            if self.steps <= s.warmup_steps:
                raise _fail(
                    f"must be < job.steps ({self.steps}) for a cosine decay (got {s.warmup_steps}; "
                    "or set schedule.decay_steps)",
                    "schedule.warmup_steps",
                )

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The default schedule (and the default ``auto_checkpoint``, ``max_restarts``,
        ``on_error``) is left out of dumps, so configurations written before they existed keep
        their fingerprint (and their checkpoints stay resumable)."""
        data: dict[str, Any] = handler(self)
        if isinstance(self.schedule, ConstantSchedule):
            data.pop("schedule", None)
        for key, default in (("auto_checkpoint", True), ("max_restarts", 3), ("on_error", "stop")):
            if data.get(key) == default:  # (left out: older configurations keep their fingerprint)
                data.pop(key, None)
        return data

    def task_spec(self) -> tuple[str, dict[str, Any]]:
        """The task's name and keyword arguments (the zoo's when ``model``/``dataset`` are set)."""
        if self.task is not None:
            return self.task, dict(self.task_args)
        assert self.model is not None and self.dataset is not None
        return ZOO_TASK, {
            "model": self.model.name,
            "dataset": self.dataset.name,
            "width": self.model.width,
            "num_samples": self.dataset.num_samples,
            "test_fraction": self.dataset.test_fraction,
            "seed": self.seed,
        }


def lr_schedule_of(job: JobConfig, total_steps: int | None = None) -> LRSchedule:
    """The pure schedule of ``job.schedule`` (``ps/lr_schedule.py``).  A cosine decay without
    ``decay_steps`` ends at the job's total steps: ``job.steps``, else ``total_steps`` (a job
    given in epochs: the sampler's steps per epoch times the epochs)."""
    match job.schedule:
        case ConstantSchedule():
            return Constant()
        case LinearWarmupSchedule(warmup_steps=w):
            return LinearWarmup(warmup_steps=w)
        case CosineSchedule(warmup_steps=w, min_lr=min_lr, decay_steps=t):
            horizon = t if t is not None else job.steps if job.steps is not None else total_steps
            if horizon is None:
                raise ConfigError(
                    "job.schedule.decay_steps: needed for a cosine schedule of a job given in epochs "
                    "where the number of steps is not known here (set decay_steps, or job.steps)"
                )
            if horizon <= w:
                raise ConfigError(
                    f"job.schedule.warmup_steps must be < the decay's end ({horizon} steps) (got {w})"
                )
            return Cosine(warmup_steps=w, decay_steps=horizon, min_factor=min_lr / job.optimizer.lr)
    raise ConfigError(f"job.schedule.kind must be constant, linear_warmup or cosine, got {job.schedule!r}")
