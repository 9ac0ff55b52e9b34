"""Builders: turn a validated :class:`~flotilla.config.RunConfig` into a task, data, model and optimizer.

Every process builds the job's task (:func:`build_task`: the user's, or the zoo's for
``job.model``/``job.dataset``) and from it the model (after ``torch.manual_seed(job.seed)``, so
replicas start identical even before the first state broadcast) and the data.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from flotilla.config import RunConfig
from flotilla.config.job import AdamOptimizer, AdamWOptimizer, SGDOptimizer, lr_schedule_of
from flotilla.core.errors import ConfigError
from flotilla.data.sampler import GlobalBatchSampler
from flotilla.ps.config import PSConfig
from flotilla.sync import registry
from flotilla.sync.spec import JobFacts
from flotilla.trainer import optim
from flotilla.trainer.task import Task
from flotilla.trainer.task_load import TaskData, TaskError, call_task, load_task


def worker_device(cfg: RunConfig, name: str | None) -> torch.device:
    """Where worker ``name`` computes: ``cpu`` for device type ``cpu``; any other type (``cuda``,
    or a GPU model such as ``V100``) is a GPU: ``cuda:i``, i = its index among the job's GPU
    workers modulo the GPUs this machine has (NCCL needs one GPU per rank)."""
    workers = cfg.cluster.resolved_workers()
    spec = next((w for w in workers if w.name == name), None)
    kind = spec.type if spec is not None else cfg.cluster.defaults.type
    if kind == "cpu":
        return torch.device("cpu")
    if not cfg.launch_plan().gpu:
        raise ConfigError(
            f"cluster: worker {name!r} has device type {kind!r}; strategy {cfg.strategy.kind} runs on cpu "
            "only (the GPU path is built for allreduce)"
        )
    if not torch.cuda.is_available():
        raise ConfigError(
            f"cluster: worker {name!r} has device type {kind!r} (a GPU) but this machine has no CUDA "
            "device (torch.cuda.is_available() is False); use type: cpu"
        )
    gpus = [w.name for w in workers if w.type != "cpu"]
    index = gpus.index(name) if name in gpus else 0
    return torch.device("cuda", index % torch.cuda.device_count())


def collective_backend(cfg: RunConfig, device: torch.device) -> str:
    """``nccl`` when every GPU worker of the job has a GPU of its own on this machine, else
    ``gloo`` (CPU workers; or GPU workers sharing a GPU, which NCCL refuses; gloo reduces CUDA
    tensors too)."""
    if device.type != "cuda":
        return "gloo"
    gpus = sum(1 for w in cfg.cluster.resolved_workers() if w.type != "cpu")
    return "nccl" if gpus <= torch.cuda.device_count() else "gloo"


def build_task(cfg: RunConfig) -> Task:
    """The job's task: ``job.task`` with ``job.task_args``, or the zoo task of ``job.model``/``dataset``."""
    name, args = cfg.job.task_spec()
    return load_task(name, args)


def build_task_model(cfg: RunConfig, task: Task) -> nn.Module:
    """The task's model, built after seeding torch with ``job.seed`` (deterministic initial weights)."""
    torch.manual_seed(cfg.job.seed)
    model = call_task(task, "build_model")
    if isinstance(model, (list, tuple)) and all(isinstance(m, nn.Module) for m in model):
        model = nn.Sequential(*model)  # an ordered list of layers
    if not isinstance(model, nn.Module):
        raise TaskError(
            f"task {type(task).__name__}: build_model() returned {type(model).__name__}, not an nn.Module"
        )
    return model


def build_task_data(task: Task) -> tuple[TaskData, TaskData]:
    """``(train, eval)`` data of the task."""
    name = type(task).__name__
    train = TaskData(call_task(task, "train_data"), f"task {name}: train_data()")
    return train, TaskData(call_task(task, "eval_data"), f"task {name}: eval_data()")


def task_sampler(cfg: RunConfig, train: TaskData) -> GlobalBatchSampler:
    """The global-batch sampler over the task's training samples."""
    return GlobalBatchSampler(
        num_samples=train.num_samples, global_batch_size=cfg.job.batch_size, seed=cfg.job.seed
    )


def build_optimizer(cfg: RunConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The job's optimizer over every parameter of ``model``, without its schedule or the task's
    hook: :func:`flotilla.trainer.optim.build_optimizer` builds both."""
    return make_optimizer(cfg.job.optimizer, model.parameters())


def make_optimizer(
    o: SGDOptimizer | AdamOptimizer | AdamWOptimizer, params: Iterable[nn.Parameter]
) -> torch.optim.Optimizer:
    """The one optimizer builder: ``job.optimizer`` (SGD, Adam or AdamW) over ``params``."""
    return optim.make_optimizer(o, params)


def total_steps(cfg: RunConfig, sampler: GlobalBatchSampler) -> int:
    """Steps of the job: ``job.steps``, or ``job.epochs`` full passes of ``sampler``."""
    if cfg.job.steps is not None:
        return cfg.job.steps
    assert cfg.job.epochs is not None  # (the job config requires exactly one of steps, epochs)
    return cfg.job.epochs * sampler.steps_per_epoch


def sync_config_of(cfg: RunConfig, total_steps: int | None = None) -> tuple[str, Any]:
    """The run's strategy as the registry builds it: its kind and what its spec's ``build`` takes
    (``StrategySpec.config``: the spec's ``package`` of the settings and the job, else the
    settings as they are).  ``total_steps``: a job given in epochs (a schedule may need it)."""
    spec, settings = cfg.strategy_spec, cfg.strategy
    if spec.build is None:
        raise ConfigError(f"strategy.kind {settings.kind!r} is not data parallel: run it with `flotilla run`")
    job = JobFacts(optimizer=cfg.job.optimizer, schedule=lambda: lr_schedule_of(cfg.job, total_steps))
    return settings.kind, spec.config(settings, job)


def strategy_options_of(cfg: RunConfig, total_steps: int | None = None) -> list[tuple[str, Any]]:
    """The workers' strategy options as the registry builds them, option 0 first: the job's
    strategy (:func:`sync_config_of`), or those a kind that runs others switches between
    (``RunConfig.strategy_options``: ``adaptive``)."""
    if cfg.strategy_spec.options is None:
        return [sync_config_of(cfg, total_steps)]
    job = JobFacts(optimizer=cfg.job.optimizer, schedule=lambda: lr_schedule_of(cfg.job, total_steps))
    out = []
    for settings in cfg.strategy_options():
        spec = registry.spec_of(settings.kind)
        if spec.build is None:
            raise ConfigError(
                f"strategy.kind {settings.kind!r} is not data parallel: it cannot be switched to"
            )
        out.append((settings.kind, spec.config(settings, job)))
    return out


def ps_config_of(cfg: RunConfig, total_steps: int | None = None) -> PSConfig:
    """The parameter server's package config of a ``ps`` run (what its shards and workers take)."""
    _, config = sync_config_of(cfg, total_steps)
    if not isinstance(config, PSConfig):
        raise ConfigError(f"strategy.kind must be 'ps' for a parameter-server job, got {cfg.strategy.kind!r}")
    return config
