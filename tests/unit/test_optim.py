"""Optimizers and learning-rate schedules (trainer/optim.py, ps/lr_schedule.py, the job config):
the curves, AdamW, the task's ``configure_optimizer`` hook and its refusals, the scheduler state
in checkpoints, and the servers' scheduled SGD."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from flotilla.config.job import AdamWOptimizer, lr_schedule_of
from flotilla.config.load import apply_overrides, validate_config
from flotilla.core.errors import ConfigError
from flotilla.elastic.checkpoint import CheckpointError, latest_checkpoint, plain_state, write_checkpoint
from flotilla.ps.lr_schedule import Constant, Cosine, LinearWarmup
from flotilla.ps.sharding import KeySpec
from flotilla.ps.store import ServerSGD
from flotilla.trainer import builders
from flotilla.trainer.builders import ps_config_of
from flotilla.trainer.optim import (
    OptimizerBundle,
    build_optimizer,
    check_optimizer,
    restore_scheduler,
    restore_scheduler_regrouped,
    scheduler_state,
    state_per_weight,
)
from flotilla.trainer.task_load import TaskError
from tests.unit.test_ps_store import ids_of, make

pytestmark = pytest.mark.timeout(30)

JOB = {
    "cluster": {"num_workers": 2},
    "job": {"task": "my.tasks:T", "optimizer": {"kind": "sgd", "lr": 0.1, "momentum": 0.0}, "steps": 20},
    "strategy": {"kind": "allreduce"},
}


def config(*overrides: str, base: dict | None = None):
    return validate_config(apply_overrides(dict(base or JOB), list(overrides)))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def lrs(bundle: OptimizerBundle, steps: int) -> list[float]:
    """The learning rate of each of ``steps`` steps (optimizer step, then scheduler step)."""
    out = []
    for _ in range(steps):
        out.append(bundle.optimizer.param_groups[0]["lr"])
        bundle.optimizer.step()
        if bundle.scheduler is not None:
            bundle.scheduler.step()
    return out


# ------------------------------------------------------------------ curves


def test_constant_schedule_has_no_scheduler_and_keeps_the_lr() -> None:
    bundle = build_optimizer(config(), model())
    assert bundle.scheduler is None and not bundle.from_task
    assert lrs(bundle, 5) == [0.1] * 5


def test_linear_warmup_rises_to_the_lr_then_stays() -> None:
    bundle = build_optimizer(config("job.schedule={kind: linear_warmup, warmup_steps: 4}"), model())
    assert lrs(bundle, 7) == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1, 0.1])


def test_cosine_warms_up_then_decays_to_min_lr_at_the_job_end() -> None:
    cfg = config("job.schedule={kind: cosine, warmup_steps: 2, min_lr: 0.01}")
    got = lrs(build_optimizer(cfg, model()), 22)
    assert got[:3] == pytest.approx([0.05, 0.1, 0.1])
    assert got[11] == pytest.approx(0.01 + 0.09 * 0.5)  # half way from step 2 to step 20
    assert got[20:] == pytest.approx([0.01, 0.01])  # decay_steps = job.steps
    assert all(a >= b for a, b in zip(got[2:], got[3:]))
    for s in range(2, 20):  # the documented formula
        p = (s - 2) / 18
        assert got[s] == pytest.approx(0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi * p)))


def test_cosine_of_an_epochs_job_needs_the_total_steps_or_decay_steps() -> None:
    cfg = config("job.steps=null", "job.epochs=2", "job.schedule={kind: cosine, warmup_steps: 1}")
    with pytest.raises(ConfigError, match="job.schedule.decay_steps"):
        lr_schedule_of(cfg.job)
    assert lr_schedule_of(cfg.job, 50) == Cosine(warmup_steps=1, decay_steps=50, min_factor=0.0)
    with pytest.raises(ConfigError, match="warmup_steps must be < the decay's end"):
        lr_schedule_of(cfg.job, 1)
    fixed = config("job.steps=null", "job.epochs=2", "job.schedule={kind: cosine, decay_steps: 9}")
    assert lr_schedule_of(fixed.job) == Cosine(decay_steps=9)


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "job.schedule={kind: step}",
            "job.schedule.kind: unknown 'step'; allowed: constant, linear_warmup, cosine",
        ),
        ("job.schedule={kind: linear_warmup}", "job.schedule.warmup_steps: missing (required)"),
        (
            "job.schedule={kind: cosine, min_lr: 0.5}",
            "job.schedule.min_lr: must be <= job.optimizer.lr (0.1) (got 0.5)",
        ),
        (
            "job.schedule={kind: cosine, warmup_steps: 20}",
            "job.schedule.warmup_steps: must be < job.steps (20) for a cosine decay "
            "(got 20; or set schedule.decay_steps)",
        ),
        (
            "job.schedule={kind: cosine, warmup_steps: 5, decay_steps: 5}",
            "job.schedule.decay_steps: must be > warmup_steps (5) (got 5)",
        ),
        (
            "job.optimizer={kind: adamw, weight_decay: -1}",
            "job.optimizer.weight_decay: must be >= 0 (got -1)",
        ),
    ],
)
def test_bad_schedules_are_one_line_naming_the_field(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(override)
    assert str(err.value) == expected


def test_pure_schedules_validate_and_load_no_torch() -> None:
    assert Constant().factor(10**6) == 1.0 and LinearWarmup(warmup_steps=2).factor(0) == 0.5
    with pytest.raises(ConfigError, match="Cosine.decay_steps"):
        Cosine(warmup_steps=3, decay_steps=3)
    with pytest.raises(ConfigError, match="Cosine.min_factor"):
        Cosine(decay_steps=3, min_factor=1.5)
    code = "import sys, flotilla.ps.lr_schedule; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_default_schedule_keeps_old_fingerprints() -> None:
    plain, cosine = config(), config("job.schedule={kind: cosine}")
    assert "schedule" not in plain.to_dict()["job"] and "schedule" in cosine.to_dict()["job"]
    assert plain.fingerprint() == config("job.schedule={kind: constant}").fingerprint()
    assert plain.fingerprint() != cosine.fingerprint()


# ------------------------------------------------------------------ optimizers


def test_adamw_is_torch_adamw_with_decoupled_weight_decay() -> None:
    cfg = config("job.optimizer={kind: adamw, lr: 0.01}")
    assert cfg.job.optimizer == AdamWOptimizer(lr=0.01) and cfg.job.optimizer.weight_decay == 0.01
    opt = build_optimizer(cfg, model()).optimizer
    assert type(opt) is torch.optim.AdamW and opt.defaults["weight_decay"] == 0.01
    assert type(builders.build_optimizer(cfg, model())) is torch.optim.AdamW  # the old entry point
    assert state_per_weight(cfg.job.optimizer) == 4.0 and state_per_weight(config().job.optimizer) == 2.0


# ------------------------------------------------------------------ the task's hook


class HookTask:
    """A task whose ``configure_optimizer`` returns whatever ``make(params)`` does."""

    def __init__(self, make) -> None:
        self.make = make
        self.seen: list[nn.Parameter] = []

    def configure_optimizer(self, params):
        self.seen = list(params)
        return self.make(self.seen)


def test_a_task_optimizer_and_scheduler_are_used_instead_of_the_config() -> None:
    m = model()
    m[0].weight.requires_grad_(False)  # frozen: not handed to the hook

    def make(params):
        opt = torch.optim.RMSprop(params, lr=0.5)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    task = HookTask(make)
    bundle = build_optimizer(config("job.schedule={kind: linear_warmup, warmup_steps: 3}"), m, task)
    assert bundle.from_task and type(bundle.optimizer) is torch.optim.RMSprop
    assert [id(p) for p in task.seen] == [id(p) for p in m.parameters() if p.requires_grad]
    assert lrs(bundle, 5) == pytest.approx([0.5, 0.5, 0.25, 0.25, 0.125])
    only = HookTask(lambda params: torch.optim.SGD(params, lr=0.3))
    assert build_optimizer(config(), model(), only).scheduler is None


def _foreign(params):
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)


def _other_scheduler(params):
    opt = torch.optim.SGD(params, lr=0.1)
    return opt, torch.optim.lr_scheduler.StepLR(torch.optim.SGD(params, lr=0.1), 1)


def _plateau(params):
    opt = torch.optim.SGD(params, lr=0.1)
    return opt, torch.optim.lr_scheduler.ReduceLROnPlateau(opt)


def _unplain(params):
    opt = torch.optim.SGD(params, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    sched.extra = torch.zeros(1)  # a tensor in its state_dict
    return opt, sched


def _fails(params):
    raise ValueError("no such layer\nsecond line")


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda p: None, "configure_optimizer() returned None; expected a torch.optim.Optimizer or a tuple"),
        (lambda p: (1, 2, 3), "returned a tuple of 3; expected"),
        (lambda p: (torch.optim.SGD(p, lr=0.1), "cosine"), "returned a str as the scheduler"),
        (_foreign, "over 2 tensor(s) that are not parameters of this process's model"),
        (_other_scheduler, "the scheduler drives another optimizer"),
        (_plateau, "ReduceLROnPlateau needs a metric"),
        (_unplain, "scheduler state: extra holds a Tensor"),
        (_fails, "configure_optimizer() failed: ValueError: no such layer"),
    ],
)
@pytest.mark.parametrize("check", [build_optimizer, check_optimizer])
def test_a_bad_hook_is_refused_with_one_line(make, expected: str, check) -> None:
    with pytest.raises(TaskError) as err:
        check(config(), model(), HookTask(make))  # (check_optimizer: the launcher's check)
    message = str(err.value)
    assert message.startswith("task HookTask: configure_optimizer()") and expected in message
    assert "\n" not in message


# The launcher's check does not build the job's own optimizer (check_optimizer): the schema must
# accept nothing torch's constructors refuse (it is stricter in places: lr 0, a beta of 0).
@pytest.mark.parametrize(
    "optimizer",
    [
        "{kind: sgd, lr: 1.0e-12, momentum: 0, weight_decay: 0}",
        "{kind: sgd, lr: 0.1, momentum: 0.999999, nesterov: true}",
        "{kind: adam, lr: 1.0e-12, betas: [0.0, 0.0], eps: 1.0e-30, weight_decay: 0}",
        "{kind: adam, betas: [0.000001, 0.999999], eps: 1.0e-30, weight_decay: 1000}",
        "{kind: adamw, lr: 1000, betas: [0.5, 0.999999], eps: 1.0e-30}",
        "{kind: adam, lr: 0}", "{kind: adam, lr: -0.1}", "{kind: adam, betas: [1.0, 0.9]}",
        "{kind: adam, betas: [0.9, -0.1]}", "{kind: adamw, eps: -1.0e-8}", "{kind: adamw, weight_decay: -1}",
        "{kind: sgd, momentum: -0.5}", "{kind: sgd, momentum: 0, nesterov: true}", "{kind: sgd, lr: 0}",
        "{kind: sgd, weight_decay: -0.1}",
    ],
)  # fmt: skip
def test_the_schema_accepts_nothing_torch_refuses(optimizer: str) -> None:
    try:
        cfg = config(f"job.optimizer={optimizer}")
    except ConfigError:
        return  # (refused before torch is asked)
    raw = dict(apply_overrides(dict(JOB), [f"job.optimizer={optimizer}"])["job"]["optimizer"])
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[raw.pop("kind")]
    if "betas" in raw:
        raw["betas"] = tuple(raw["betas"])
    cls(model().parameters(), **raw)  # (a ValueError here: the schema let through what torch refuses)
    build_optimizer(cfg, model())


def test_the_launchers_check_refuses_a_bad_schedule_and_imports_no_dynamo() -> None:
    cfg = config("job.schedule={kind: cosine, warmup_steps: 50}", "job.steps=null", "job.epochs=1")
    with pytest.raises(ConfigError, match="warmup_steps must be < the decay's end"):
        check_optimizer(cfg, model(), total_steps=40)  # (a job in epochs: its length known here)
    with pytest.raises(ConfigError, match="decay_steps: needed"):
        check_optimizer(cfg, model())
    code = (
        "import sys; from flotilla.config import load_config; "
        "from flotilla.launch.validation import validate; "
        "validate(load_config('examples/tiny.yaml')); print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # (1.2 s of CPU beside the workers starting up)


def test_a_hook_is_refused_where_the_servers_apply_the_optimizer() -> None:
    cfg = config("strategy={kind: ps, update: server_sgd}")
    with pytest.raises(
        TaskError, match="cannot be used with strategy.update 'server_sgd'.*use update: delta"
    ):
        build_optimizer(cfg, model(), HookTask(lambda p: torch.optim.SGD(p, lr=0.1)))
    delta = config("strategy={kind: ps, update: delta}")
    assert build_optimizer(delta, model(), HookTask(lambda p: torch.optim.SGD(p, lr=0.1))).from_task


# ------------------------------------------------------------------ checkpointed scheduler state


@pytest.mark.parametrize("schedule", ["{kind: cosine, warmup_steps: 3}", "task"])
def test_scheduler_state_round_trips_through_a_checkpoint(tmp_path, schedule: str) -> None:
    """Stop after 7 steps, checkpoint, restore into a fresh bundle: the next steps' learning rates
    are bitwise those of an uninterrupted run."""

    def hook(params):
        opt = torch.optim.SGD(params, lr=0.2)
        return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.4, total_steps=20)

    cfg = config() if schedule == "task" else config(f"job.schedule={schedule}")
    task = HookTask(hook) if schedule == "task" else None
    straight = lrs(build_optimizer(cfg, model(), task), 20)
    first = build_optimizer(cfg, model(), task)
    assert lrs(first, 7) == straight[:7]
    write_checkpoint(
        tmp_path,
        step=7,
        parts={"model": {}},
        meta={},
        fingerprint="f",
        scheduler=scheduler_state(first.scheduler),
    )
    ckpt = latest_checkpoint(tmp_path, fingerprint="f")
    assert ckpt.scheduler is not None and ckpt.scheduler["last_epoch"] == 7
    again = build_optimizer(cfg, model(), task)
    restore_scheduler(again, ckpt.scheduler)
    assert lrs(again, 13) == straight[7:]  # exact: JSON keeps every float


def test_checkpoints_without_a_scheduler_still_load(tmp_path) -> None:
    path = write_checkpoint(
        tmp_path, step=1, parts={"model": {"w": torch.ones(2)}}, meta={"a": 1}, fingerprint="f"
    )
    manifest = json.loads((path / "manifest.json").read_text())
    assert "scheduler" not in manifest  # the same manifest as before schedules existed
    ckpt = latest_checkpoint(tmp_path, fingerprint="f")
    assert ckpt.scheduler is None and ckpt.meta == {"a": 1}
    bundle = build_optimizer(config("job.schedule={kind: linear_warmup, warmup_steps: 2}"), model())
    restore_scheduler(bundle, ckpt.scheduler)  # nothing to restore: left as built
    assert bundle.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_a_scheduler_state_that_does_not_fit_is_refused() -> None:
    with pytest.raises(CheckpointError, match="this job has no schedule"):
        restore_scheduler(build_optimizer(config(), model()), {"last_epoch": 3})
    bundle = build_optimizer(config("job.schedule={kind: linear_warmup, warmup_steps: 2}"), model())
    with pytest.raises(CheckpointError, match="keys gamma that this job's LambdaLR lacks"):
        restore_scheduler(bundle, {"last_epoch": 3, "gamma": 0.5})
    with pytest.raises(CheckpointError, match=r"scheduler state: a\.b\[1\] holds a Tensor"):
        plain_state({"a": {"b": [1, torch.ones(1)]}}, "scheduler state")
    assert plain_state({"t": (1, 2.5, None)}, "x") == {"t": [1, 2.5, None]}


# ------------------------------------------------------------------ the servers' schedule


def test_server_sgd_follows_the_schedule_like_torch_sgd_with_lambdalr() -> None:
    """Three workers push every clock in a shuffled order under BSP; after each clock the shard
    holds torch.optim.SGD + LambdaLR (stepped once per step) on the summed gradient."""
    schedule = Cosine(warmup_steps=2, decay_steps=6, min_factor=0.1)
    rule = ServerSGD(lr=0.05, momentum=0.9, weight_decay=0.01, schedule=schedule)
    store = make(update=rule, num_workers=3, keys=(KeySpec.of("w", (40,), "float32"),), chunk_bytes=64)
    param = torch.nn.Parameter(torch.cat(store.read(ids_of(store))[0]).clone().double())
    opt = torch.optim.SGD([param], lr=0.05, momentum=0.9, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule.factor)
    gen = torch.Generator().manual_seed(1)
    for clock in range(8):
        grads = [torch.randn(40, generator=gen) for _ in range(3)]
        for worker in torch.randperm(3, generator=gen).tolist():
            parts = list(grads[worker].split([store.layout.plan.chunks[c].num_elems for c in ids_of(store)]))
            store.push(worker, clock, store.version, ids_of(store), parts)
        param.grad = torch.stack(grads).sum(0).double()
        opt.step()
        sched.step()
        w = torch.cat(store.read(ids_of(store))[0])
        assert torch.allclose(w.double(), param.detach(), rtol=1e-5, atol=1e-6), clock


def test_the_servers_get_the_jobs_schedule_only_for_server_sgd() -> None:
    cfg = config("strategy={kind: ps, update: server_sgd}", "job.schedule={kind: cosine, warmup_steps: 2}")
    rule = ps_config_of(cfg).update
    assert isinstance(rule, ServerSGD) and rule.schedule == Cosine(warmup_steps=2, decay_steps=20)
    assert rule.lr_at(0) == pytest.approx(0.05) and rule.lr_at(20) == 0.0
    assert ServerSGD(lr=0.3).lr_at(5) == 0.3
    assert build_optimizer(cfg, model()).scheduler is None  # the workers' optimizers are not stepped
    delta = config("strategy={kind: ps, update: delta}", "job.schedule={kind: cosine, warmup_steps: 2}")
    assert not isinstance(ps_config_of(delta).update, ServerSGD)  # the workers' optimizers follow it
    assert isinstance(build_optimizer(delta, model()).scheduler, torch.optim.lr_scheduler.LambdaLR)


def test_a_schedule_saved_for_other_parameter_groups_keeps_its_step_in_a_regrouped_stage() -> None:
    """A re-partitioned pipeline stage (trainer/pipeline_checkpoint.restore_reshaped): the old
    stage had one parameter group (AdamW with weight decay on weights only: a bias-free layer),
    the new one two; the schedule goes on from its step with one lr per new group."""
    cfg = config(
        "job.optimizer={kind: adamw, lr: 0.1, weight_decay: 0.01}",
        "job.schedule={kind: cosine, warmup_steps: 2, min_lr: 0.01}",
    )
    old = build_optimizer(cfg, nn.Linear(3, 4, bias=False))
    assert len(old.optimizer.param_groups) == 1
    expected = lrs(old, 8)  # 5 steps done, then 3 more: the lrs the resumed stage must see
    old = build_optimizer(cfg, nn.Linear(3, 4, bias=False))
    lrs(old, 5)
    state = scheduler_state(old.scheduler)
    new = build_optimizer(cfg, model())
    assert len(new.optimizer.param_groups) == 2
    with pytest.raises(ValueError):  # (what loading it whole would do at the next step)
        broken = build_optimizer(cfg, model())
        restore_scheduler(broken, state)
        lrs(broken, 1)
    restore_scheduler_regrouped(new, state)
    assert new.scheduler is not None and new.scheduler.last_epoch == 5
    got = []
    for _ in range(3):
        assert new.optimizer.param_groups[0]["lr"] == new.optimizer.param_groups[1]["lr"]
        got.append(new.optimizer.param_groups[0]["lr"])
        new.optimizer.step()
        new.scheduler.step()
    assert got == pytest.approx(expected[5:])
    restore_scheduler_regrouped(build_optimizer(config(), model()), state)  # no schedule here: ignored
