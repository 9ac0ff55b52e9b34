"""The optimizer and learning-rate schedule of the model (or pipeline stage) one process holds.

:func:`build_optimizer` returns an :class:`OptimizerBundle` ``(optimizer, scheduler | None)``:

- from the task, if it defines ``configure_optimizer(params)`` (a Lightning-like hook; ``params``
  is the list of trainable parameters of the model or stage this process holds).  It returns an
  optimizer, or a tuple ``(optimizer, scheduler)`` with ``scheduler`` a
  ``torch.optim.lr_scheduler.LRScheduler`` of that optimizer (or None).  The job's
  ``optimizer``/``schedule`` are then not used.  Anything else is refused with one
  :class:`~flotilla.trainer.task_load.TaskError` line;
- else from the job: ``job.optimizer`` (``sgd``, ``adam``, ``adamw``) over the model's
  parameters (weight decay on the weights only unless ``weight_decay_on: all``:
  :func:`param_groups`), and ``job.schedule`` as a ``LambdaLR`` whose factor is the pure curve of
  ``ps/lr_schedule.py`` (None for the constant schedule: the optimizer's lr never changes).

The caller steps the scheduler once per optimizer step, after the step was committed (so
``scheduler.last_epoch`` equals the number of committed steps), and checkpoints its
``state_dict`` (plain numbers, JSON in the checkpoint manifest: :func:`scheduler_state`,
:func:`restore_scheduler`).  Parameter groups are not part of a replica's transferred or
checkpointed optimizer state (``sync/state.py``), so :func:`restore_scheduler` also sets each
group's lr to the scheduler's last one.

A model without trainable parameters (a pipeline stage of parameter-free or frozen layers) gets an
:func:`idle_optimizer` and no scheduler; a task's hook is not called for it.

``job.optimizer.clip_grad_norm`` is a step pre-hook on the optimizer (:func:`clip_before_step`):
whatever calls ``optimizer.step()`` -- the all-reduce strategy after writing back the reduced
gradients, the PS delta rule on a worker's local mean gradient -- clips first.  A pipeline stage
is built with ``clip_locally=False``: its engine clips on the norm over all stages.

Under ``strategy: ps`` with ``update: server_sgd`` the servers apply ``job.optimizer`` and
``job.schedule`` (``ServerSGD.lr_at``): the worker's optimizer is never stepped, the bundle has
no scheduler, and a task's own optimizer is refused.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

from flotilla.config import RunConfig
from flotilla.config.job import AdamOptimizer, AdamWOptimizer, SGDOptimizer, lr_schedule_of
from flotilla.core.errors import ConfigError
from flotilla.elastic.checkpoint import CheckpointError, plain_state
from flotilla.ps.lr_schedule import Constant, LRSchedule
from flotilla.trainer.task_load import TaskError, call_task

__all__ = [
    "HOOK",
    "OptimizerBundle",
    "build_optimizer",
    "check_optimizer",
    "clip_before_step",
    "clip_coefficient",
    "idle_optimizer",
    "make_optimizer",
    "make_scheduler",
    "param_groups",
    "restore_scheduler",
    "restore_scheduler_regrouped",
    "scheduler_state",
    "state_per_weight",
]

HOOK = "configure_optimizer"


@dataclass(frozen=True, slots=True)
class OptimizerBundle:
    """A process's optimizer, its scheduler (None: constant lr) and where they came from."""

    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler | None = None
    from_task: bool = False


def param_groups(
    params: Iterable[nn.Parameter], weight_decay: float, weight_decay_on: str
) -> list[dict[str, Any]]:
    """``params`` as the optimizer's parameter groups: one group (``weight_decay_on: all``, or no
    decay at all), else the decayed weights (two or more dimensions) and, with ``weight_decay``
    0, the rest (biases, normalisation scales, scalars).  The order of ``params`` is kept within
    each group, so every process holding the same parameters builds the same groups."""
    plist = list(params)
    if weight_decay == 0 or weight_decay_on == "all":
        return [{"params": plist}]
    decayed = [p for p in plist if p.ndim >= 2]
    rest = [p for p in plist if p.ndim < 2]
    groups: list[dict[str, Any]] = [{"params": decayed}] if decayed else []
    if rest:
        groups.append({"params": rest, "weight_decay": 0.0})
    return groups or [{"params": plist}]


def make_optimizer(
    o: SGDOptimizer | AdamOptimizer | AdamWOptimizer, params: Iterable[nn.Parameter]
) -> torch.optim.Optimizer:
    """``job.optimizer`` (SGD, Adam or AdamW) over ``params`` (parameter groups: :func:`param_groups`;
    clipping is :func:`clip_before_step`'s)."""
    plist = list(params)
    # CUDA parameters: torch's fused Adam/AdamW (one kernel for the whole update, fewer launches,
    # and it can skip a non-finite step on the device: sync/state.py guards_on_device)
    fused = {"fused": True} if plist and all(p.is_cuda and p.is_floating_point() for p in plist) else {}
    params = param_groups(plist, o.weight_decay, o.weight_decay_on)  # type: ignore[assignment]
    if isinstance(o, SGDOptimizer):
        return torch.optim.SGD(
            params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, nesterov=o.nesterov
        )
    betas = (o.betas[0], o.betas[1])
    if isinstance(o, AdamWOptimizer):
        return torch.optim.AdamW(
            params, lr=o.lr, betas=betas, eps=o.eps, weight_decay=o.weight_decay, **fused
        )
    if isinstance(o, AdamOptimizer):
        return torch.optim.Adam(params, lr=o.lr, betas=betas, eps=o.eps, weight_decay=o.weight_decay, **fused)
    raise ConfigError(f"job.optimizer.kind must be one of sgd, adam, adamw, got {getattr(o, 'kind', o)!r}")


def idle_optimizer() -> torch.optim.Optimizer:
    """The optimizer of a model (a pipeline stage) without trainable parameters -- parameter-free
    or frozen layers: plain SGD over one 0-element placeholder, so its steps change nothing and
    its state is empty (torch refuses an optimizer over no parameters)."""
    return torch.optim.SGD([nn.Parameter(torch.zeros(0))], lr=0.0)


def clip_before_step(optimizer: torch.optim.Optimizer, max_norm: float | None) -> None:
    """Clip the gradients of ``optimizer``'s parameters to the global L2 norm ``max_norm`` before
    each of its steps (a step pre-hook, so every strategy's ``optimizer.step()`` clips the
    gradients it is stepped on).  None: nothing."""
    if max_norm is None:
        return

    def clip(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        grads = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            nn.utils.clip_grad_norm_(grads, max_norm)

    optimizer.register_step_pre_hook(clip)


def clip_coefficient(squared_norm: float, max_norm: float) -> float:
    """The factor that brings a gradient of global ``sqrt(squared_norm)`` down to ``max_norm``
    (1.0 when it is within; torch's ``clip_grad_norm_`` rule, its 1e-6 included)."""
    return min(1.0, max_norm / (squared_norm**0.5 + 1e-6))


def state_per_weight(o: SGDOptimizer | AdamOptimizer | AdamWOptimizer) -> float:
    """Tensors the size of the weights that training keeps per weight: the weight, its gradient
    and the optimizer's state (SGD: + momentum buffer if any; Adam/AdamW: + two moments)."""
    if isinstance(o, SGDOptimizer):
        return 3.0 if o.momentum > 0 else 2.0
    return 4.0


def make_scheduler(schedule: LRSchedule, optimizer: torch.optim.Optimizer) -> LRScheduler | None:
    """A ``LambdaLR`` following ``schedule`` (None for :class:`Constant`).  The factor is a plain
    function, so the scheduler's ``state_dict`` holds numbers only."""
    if isinstance(schedule, Constant):
        return None

    def factor(step: int) -> float:
        return schedule.factor(step)

    return LambdaLR(optimizer, factor)


def warm_imports() -> None:
    """Import now what building the first optimizer imports (``torch._dynamo``, through
    ``torch.optim``'s ``add_param_group``: about 1.3 s here), e.g. while a worker waits for its
    coordinator."""
    import torch._dynamo  # noqa: F401


def build_optimizer(
    cfg: RunConfig,
    model: nn.Module,
    task: object | None = None,
    *,
    total_steps: int | None = None,
    clip_locally: bool = True,
) -> OptimizerBundle:
    """The optimizer and scheduler for ``model`` (the whole model, or this process's stage): the
    task's ``configure_optimizer`` if it has one, else the job's (module doc).  ``total_steps``:
    the job's length, needed only by a cosine schedule without ``decay_steps`` in a job given in
    epochs.  ``job.optimizer.clip_grad_norm`` clips before every step (also a hook's optimizer)
    unless ``clip_locally`` is False (a pipeline stage: the norm is global over the stages, the
    stage engine clips)."""
    if not any(p.requires_grad for p in model.parameters()):
        return OptimizerBundle(idle_optimizer(), None, from_task=False)
    hook = getattr(task, HOOK, None) if task is not None else None
    clip = cfg.job.optimizer.clip_grad_norm if clip_locally else None
    if callable(hook):
        _refuse_server_sgd(cfg, task)
        bundle = _from_task(task, model)
        clip_before_step(bundle.optimizer, clip)
        return bundle
    optimizer = make_optimizer(cfg.job.optimizer, model.parameters())
    clip_before_step(optimizer, clip)
    if _servers_apply_it(cfg):  # the servers follow job.schedule; this optimizer is never stepped
        return OptimizerBundle(optimizer, None, from_task=False)
    scheduler = make_scheduler(lr_schedule_of(cfg.job, total_steps), optimizer)
    return OptimizerBundle(optimizer, scheduler, from_task=False)


def check_optimizer(
    cfg: RunConfig, model: nn.Module, task: object | None = None, *, total_steps: int | None = None
) -> None:
    """What :func:`build_optimizer` would refuse, found before anything starts (the launcher's
    check).  A task's ``configure_optimizer`` hook is called and its result checked (the user's
    code: only running it tells).  The job's own optimizer is NOT built: its arguments are bounded
    by the config schema at least as tightly as torch's constructors check them (``lr`` > 0, betas
    in (0, 1), ``eps`` > 0, ``weight_decay`` >= 0, Nesterov with momentum), and building a torch
    optimizer imports ``torch._dynamo`` -- about 1 s of CPU in the launcher, taken from the workers
    starting beside it on a small machine.  Its schedule is checked as built (pure)."""
    if not any(p.requires_grad for p in model.parameters()):
        return  # (build_optimizer's idle optimizer: no hook called, no schedule)
    if callable(getattr(task, HOOK, None)):
        build_optimizer(cfg, model, task, total_steps=total_steps)
        return
    lr_schedule_of(cfg.job, total_steps)


def _servers_apply_it(cfg: RunConfig) -> bool:
    return cfg.strategy.servers_apply_optimizer()


def _refuse_server_sgd(cfg: RunConfig, task: object) -> None:
    if _servers_apply_it(cfg):
        raise TaskError(
            f"task {type(task).__name__}: {HOOK}() cannot be used with strategy.update 'server_sgd' "
            "(the servers apply job.optimizer); use update: delta"
        )


def _from_task(task: Any, model: nn.Module) -> OptimizerBundle:
    """Call the task's hook with the trainable parameters and check what it returns."""
    name = f"task {type(task).__name__}: {HOOK}()"
    params = [p for p in model.parameters() if p.requires_grad]
    result = call_task(task, HOOK, params)
    scheduler: object = None
    if isinstance(result, (tuple, list)) and len(result) == 2:
        result, scheduler = result
    if not isinstance(result, torch.optim.Optimizer):
        raise TaskError(
            f"{name} returned {_kind(result)}; expected a torch.optim.Optimizer or a tuple "
            "(optimizer, lr_scheduler)"
        )
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in result.param_groups for p in g["params"] if id(p) not in own)
    if foreign:
        raise TaskError(
            f"{name} returned an optimizer over {foreign} tensor(s) that are not parameters of this "
            "process's model; build it from the params argument"
        )
    if scheduler is not None:
        _check_scheduler(name, scheduler, result)
    return OptimizerBundle(result, scheduler, from_task=True)  # type: ignore[arg-type]


def _check_scheduler(name: str, scheduler: object, optimizer: torch.optim.Optimizer) -> None:
    if isinstance(scheduler, ReduceLROnPlateau):
        raise TaskError(
            f"{name}: ReduceLROnPlateau needs a metric at every step; flotilla steps the scheduler "
            "once per step without one (use a step-based scheduler)"
        )
    if not isinstance(scheduler, LRScheduler):
        raise TaskError(
            f"{name} returned {_kind(scheduler)} as the scheduler; expected a "
            "torch.optim.lr_scheduler.LRScheduler or None"
        )
    if scheduler.optimizer is not optimizer:
        raise TaskError(f"{name}: the scheduler drives another optimizer than the one returned")
    try:
        plain_state(scheduler.state_dict(), "scheduler state")
    except CheckpointError as exc:
        raise TaskError(f"{name}: {exc} (its state could not be checkpointed)") from None


def _kind(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return "None" if value is None else f"a {type(value).__name__}"


def scheduler_state(scheduler: LRScheduler | None) -> dict[str, Any] | None:
    """The scheduler's ``state_dict`` as plain JSON data (for ``write_checkpoint(scheduler=...)``
    or a replica's state transfer), None without a scheduler."""
    if scheduler is None:
        return None
    state: dict[str, Any] = plain_state(scheduler.state_dict(), "scheduler state")
    return state


def restore_scheduler(bundle: OptimizerBundle, state: Mapping[str, Any] | None) -> None:
    """Load ``state`` (from :func:`scheduler_state`) into the bundle's scheduler and set every
    parameter group's lr to the scheduler's last one (the lr of the next step).  ``state`` None
    (a checkpoint without a scheduler) leaves the scheduler as built; a state for a bundle
    without a scheduler, or with keys this scheduler lacks, is a :class:`CheckpointError`."""
    if state is None:
        return
    sched = bundle.scheduler
    if sched is None:
        raise CheckpointError("the checkpoint holds a scheduler state but this job has no schedule")
    unknown = sorted(set(state) - set(sched.state_dict()))
    if unknown:
        raise CheckpointError(
            f"the checkpoint's scheduler state has keys {', '.join(unknown)} that this job's "
            f"{type(sched).__name__} lacks (another scheduler?)"
        )
    sched.load_state_dict(dict(state))
    for group, lr in zip(bundle.optimizer.param_groups, sched.get_last_lr()):
        group["lr"] = lr


def restore_scheduler_regrouped(bundle: OptimizerBundle, state: Mapping[str, Any] | None) -> None:
    """:func:`restore_scheduler` for a state written by an optimizer with other parameter groups (a
    re-partitioned pipeline stage): its step count is kept and the per-group values (``base_lrs``,
    ``_last_lr``) are recomputed for this optimizer's groups.  Only the job's own schedule can be
    recomputed so; a task's own scheduler with another number of groups is a CheckpointError.
    Without a scheduler here (a stage with nothing to train) the state is ignored."""
    sched = bundle.scheduler
    if state is None or sched is None:
        return
    groups = bundle.optimizer.param_groups
    lists = {k for k, v in state.items() if isinstance(v, list)}
    if all(len(state[k]) == len(groups) for k in lists):
        restore_scheduler(bundle, state)
        return
    if bundle.from_task:
        raise CheckpointError(
            "re-partitioning: the task's own LR scheduler was saved for another number of parameter "
            "groups; resume with the checkpoint's number of stages"
        )
    kept = {k: v for k, v in state.items() if k not in lists}
    if state.get("lr_lambdas"):  # (LambdaLR: one entry per group, the same curve for all of ours)
        kept["lr_lambdas"] = [state["lr_lambdas"][0]] * len(groups)
    restore_scheduler(bundle, kept)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (get_lr outside step(): the closed form at last_epoch)
        lrs = list(sched.get_lr())
    sched._last_lr = lrs
    for group, lr in zip(groups, lrs):
        group["lr"] = lr
