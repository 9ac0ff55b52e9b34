"""Builders: turn a validated :class:`~flotilla.config.RunConfig` into a task, data, model and optimizer.

Every process builds the job's task (:func:`build_task`: the user's, or the zoo's for
``job.model``/``job.dataset``) and from it the model (after ``torch.manual_seed(job.seed)``, so
replicas start identical even before the first state broadcast) and the data.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from flotilla.cluster.gpu_placement import ONE_HOST_VAR, GpuPlacement, place_gpus
from flotilla.config import RunConfig
from flotilla.config.job import AdamOptimizer, AdamWOptimizer, SGDOptimizer, lr_schedule_of
from flotilla.core.errors import ConfigError, OutOfMemory
from flotilla.data.sampler import GlobalBatchSampler
from flotilla.ps.config import PSConfig
from flotilla.sync import registry
from flotilla.sync.spec import JobFacts
from flotilla.trainer import optim
from flotilla.trainer.task import Task
from flotilla.trainer.task_load import TaskData, TaskError, call_task, load_task


def gpu_placement(cfg: RunConfig, *, one_host: bool | None = None) -> GpuPlacement:
    """Which GPU each CUDA worker computes on and the job's transport
    (:mod:`flotilla.cluster.gpu_placement`); needs CUDA.  ``one_host``: every worker runs on this
    machine (default: this process was started by ``flotilla run``, ``$FLOTILLA_ONE_HOST``)."""
    workers = [(w.name, w.node, w.device) for w in cfg.cluster.resolved_workers()]
    if one_host is None:
        one_host = os.environ.get(ONE_HOST_VAR) == "1"
    r = cfg.cluster.revocations
    joiners = r.random is not None or r.trace is not None or any(e.action == "add" for e in r.events)
    return place_gpus(workers, torch.cuda.device_count(), one_host=one_host, joiners=joiners)


def _freest_gpu() -> int:
    """The visible GPU with the most free memory (a worker the configuration does not list)."""
    free = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
    return max(range(len(free)), key=free.__getitem__)


def worker_device(cfg: RunConfig, name: str | None) -> torch.device:
    """Where worker ``name`` computes: ``cpu``, or for ``device: cuda`` its GPU on its host
    (:func:`gpu_placement`).  The device class ``type`` (``V100``, ...) is a label: an emulated
    class computes on cpu unless its ``device`` says cuda."""
    if cfg.cluster.worker(name or "").device == "cpu":  # (no name: the cluster's defaults)
        return torch.device("cpu")
    if not cfg.launch_plan().gpu:
        raise ConfigError(
            f"cluster: worker {name!r} has device cuda; strategy {cfg.strategy.kind} runs on cpu only "
            "(its spec declares no GPU path: LaunchNeeds.gpu)"
        )
    if not torch.cuda.is_available():
        raise ConfigError(
            f"cluster: worker {name!r} has device cuda but this machine has no usable CUDA device "
            f"(torch.cuda.is_available() is False; torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}); use device: cpu"
        )
    index = gpu_placement(cfg).index.get(name or "")
    return torch.device("cuda", index if index is not None else _freest_gpu())


def collective_backend(cfg: RunConfig, device: torch.device) -> str:
    """``nccl`` when every worker of the job is a CUDA worker with a GPU of its own and none joins
    later, else ``gloo`` (a CPU worker in the group; CUDA workers sharing a GPU, which NCCL
    refuses; joiners; gloo reduces CUDA tensors): ``GpuPlacement.backend``."""
    if device.type != "cuda":
        return "gloo"
    return gpu_placement(cfg).backend


def out_of_memory(what: str, device: torch.device, exc: BaseException) -> OutOfMemory:
    """The one line for a CUDA out-of-memory error of ``what`` (``worker 'w0'``, ``stage 1 ('slow')``):
    the device, its memory and what the process held, then torch's own first line."""
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    held = ""
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        held = (
            f" ({props.name}, {props.total_memory / 2**30:.1f} GiB; this process held "
            f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB at its peak)"
        )
    return OutOfMemory(
        f"{what} ran out of memory on {device}{held}: {line} -- a smaller batch (job.batch_size, "
        "job.accumulate), a pipeline over more stages, or job.precision: bf16 needs less"
    )


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


def task_sampler(cfg: RunConfig, train: TaskData, model: nn.Module | None = None) -> GlobalBatchSampler:
    """The global-batch sampler over the task's training samples; a ``model`` with BatchNorm
    layers (no training on one sample: PyTorch raises) gets shards of 2 samples at least."""
    return GlobalBatchSampler(
        num_samples=train.num_samples,
        global_batch_size=cfg.job.batch_size,
        seed=cfg.job.seed,
        min_shard=min_samples(model) if model is not None else 1,
    )


# (every BatchNorm, lazy and synchronised ones included, derives from it: torch has no public base)
_BATCH_NORMS = (nn.modules.batchnorm._BatchNorm,)


def min_samples(model: nn.Module) -> int:
    """The fewest samples ``model`` trains on in one forward pass: 2 with a BatchNorm layer (its
    batch statistics need two), else 1."""
    return 2 if any(isinstance(m, _BATCH_NORMS) for m in model.modules()) else 1


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
