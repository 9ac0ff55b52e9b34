"""``job.optimizer.clip_grad_norm`` and ``job.optimizer.weight_decay_on`` (docs/optimizers.md):
validated with one line naming the field; weight decay leaves biases and normalisation scales out
unless ``weight_decay_on: all``; clipping happens before every step of the optimizer the job
builds (also a task's own), and equals torch's ``clip_grad_norm_`` on the same gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from flotilla.config.load import apply_overrides, validate_config
from flotilla.core.errors import ConfigError
from flotilla.trainer.optim import build_optimizer, clip_coefficient, param_groups

pytestmark = pytest.mark.timeout(30)

JOB = {
    "cluster": {"num_workers": 2},
    "job": {"task": "my.tasks:T", "optimizer": {"kind": "sgd", "lr": 0.1, "momentum": 0.0}, "steps": 20},
    "strategy": {"kind": "allreduce"},
}


def config(*overrides: str):
    return validate_config(apply_overrides(copy.deepcopy(JOB), list(overrides)))


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2), nn.LayerNorm(2))


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["job.optimizer.clip_grad_norm=0"], "job.optimizer.clip_grad_norm: must be > 0 (got 0)"),
        (["job.optimizer.clip_grad_norm=-1"], "job.optimizer.clip_grad_norm: must be > 0 (got -1)"),
        (
            ["job.optimizer.weight_decay_on=biases"],
            "job.optimizer.weight_decay_on: unknown 'biases'; allowed: weights, all",
        ),
        (
            ["job.optimizer.clip_grad_norm=1", "strategy={kind: ps, update: server_sgd}"],
            "job.optimizer.clip_grad_norm: cannot be used with strategy.update 'server_sgd' (the servers "
            "step on the sum of the pushes; nobody sees the global gradient to clip); use update: delta",
        ),
        (
            ["job.optimizer.weight_decay=0.1", "strategy={kind: ps, update: server_sgd}"],
            "job.optimizer.weight_decay_on: 'weights' cannot be used with strategy.update 'server_sgd' "
            "(the servers decay every parameter); set weight_decay_on: all, or use update: delta",
        ),
        (
            [
                "job.optimizer.clip_grad_norm=1",
                "strategy={kind: pipeline, schedule: pipedream, num_stages: 2}",
            ],
            "job.optimizer.clip_grad_norm: cannot be used with strategy.schedule 'pipedream' (no flush at "
            "which the stages could agree on the global norm); use schedule gpipe or 1f1b",
        ),
    ],
)
def test_bad_settings_are_one_line_naming_the_field(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(*overrides)
    assert str(err.value) == expected


def test_allowed_combinations_validate() -> None:
    config(
        "job.optimizer.weight_decay=0.1",
        "job.optimizer.weight_decay_on=all",
        "strategy={kind: ps, update: server_sgd}",
    )
    config("job.optimizer.clip_grad_norm=1", "strategy={kind: ps, update: delta}")
    config("job.optimizer.clip_grad_norm=1", "strategy={kind: pipeline, schedule: 1f1b, num_stages: 2}")


def test_settings_without_effect_keep_old_fingerprints() -> None:
    plain = config()
    assert "clip_grad_norm" not in plain.to_dict()["job"]["optimizer"]
    assert "weight_decay_on" not in plain.to_dict()["job"]["optimizer"]
    assert plain.fingerprint() == config("job.optimizer.weight_decay_on=all").fingerprint()  # (no decay)
    assert plain.fingerprint() != config("job.optimizer.clip_grad_norm=1").fingerprint()
    decayed = config("job.optimizer.weight_decay=0.1")
    assert (
        decayed.fingerprint()
        != config("job.optimizer.weight_decay=0.1", "job.optimizer.weight_decay_on=all").fingerprint()
    )


def test_weight_decay_leaves_biases_and_norms_out_unless_asked() -> None:
    m = bn_model()
    groups = param_groups(m.parameters(), 0.1, "weights")
    decayed = {id(p) for p in groups[0]["params"]}
    assert decayed == {id(m[0].weight), id(m[3].weight)}
    assert groups[1]["weight_decay"] == 0.0 and len(groups[1]["params"]) == 6  # 2 biases, BN w/b, LN w/b
    assert len(param_groups(m.parameters(), 0.1, "all")) == 1
    assert len(param_groups(m.parameters(), 0.0, "weights")) == 1


@pytest.mark.parametrize("on", ["weights", "all"])
def test_adamw_steps_like_torch_with_the_same_groups(on: str) -> None:
    cfg = config("job.optimizer={kind: adamw, lr: 0.01, weight_decay: 0.5, weight_decay_on: " + on + "}")
    m, ref = bn_model(), bn_model()
    opt = build_optimizer(cfg, m).optimizer
    if on == "weights":
        w = [ref[0].weight, ref[3].weight]
        rest = [p for p in ref.parameters() if all(p is not q for q in w)]
        ref_opt = torch.optim.AdamW(
            [{"params": w}, {"params": rest, "weight_decay": 0.0}], lr=0.01, weight_decay=0.5
        )
    else:
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.5)
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    for mod, o in ((m, opt), (ref, ref_opt)):
        for _ in range(3):
            o.zero_grad()
            mod(x).pow(2).sum().backward()
            o.step()
    for a, b in zip(m.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    if on == "weights":  # (and the groups matter: decaying everything would give other weights)
        other = bn_model()
        other_opt = torch.optim.AdamW(other.parameters(), lr=0.01, weight_decay=0.5)
        for _ in range(3):
            other_opt.zero_grad()
            other(x).pow(2).sum().backward()
            other_opt.step()
        assert not all(torch.equal(a, b) for a, b in zip(m.parameters(), other.parameters(), strict=True))


@pytest.mark.parametrize("hook", [False, True])
def test_clipping_is_torch_clip_grad_norm_before_every_step(hook: bool) -> None:
    class T:
        def configure_optimizer(self, params):
            return torch.optim.SGD(params, lr=1.0)

    cfg = config("job.optimizer={kind: sgd, lr: 1.0, momentum: 0, clip_grad_norm: 0.5}")
    m, ref = bn_model(), bn_model()
    opt = build_optimizer(cfg, m, T() if hook else None).optimizer
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1)) * 10
    m(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    norm = nn.utils.clip_grad_norm_(list(ref.parameters()), 0.5)
    assert float(norm) > 5  # (the gradient really was clipped)
    before = [p.detach().clone() for p in m.parameters()]
    opt.step()
    for b, p, r in zip(before, m.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(b - p, r.grad, rtol=1e-6, atol=1e-7)
    total = torch.stack([(b - p).pow(2).sum() for b, p in zip(before, m.parameters(), strict=True)]).sum()
    assert float(total.detach().sqrt()) == pytest.approx(0.5, rel=1e-5)


def test_no_clipping_without_the_setting() -> None:
    m = bn_model()
    opt = build_optimizer(config("job.optimizer={kind: sgd, lr: 1.0, momentum: 0}"), m).optimizer
    m(torch.randn(8, 3) * 10).pow(2).sum().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    before = [p.detach().clone() for p in m.parameters()]
    opt.step()
    for b, p, g in zip(before, m.parameters(), grads, strict=True):
        torch.testing.assert_close(b - p, g)


def test_clip_coefficient() -> None:
    assert clip_coefficient(4.0, 10.0) == 1.0
    assert clip_coefficient(400.0, 10.0) == pytest.approx(0.5, rel=1e-6)


def test_ps_delta_rule_clips_the_workers_local_mean_gradient() -> None:
    """Under ``ps`` with ``update: delta`` the clip applies to the gradient a worker steps on: its
    local mean gradient ``N·g`` (the loss was scaled by 1/global_batch), then ``u = Δw / N``."""
    from flotilla.ps.config import DeltaUpdate, PSConfig
    from flotilla.sync.ps_update import WorkerUpdate

    cfg = config("job.optimizer={kind: sgd, lr: 1.0, momentum: 0, clip_grad_norm: 0.5}")
    m = bn_model()
    opt = build_optimizer(cfg, m).optimizer
    params = {n: p for n, p in m.named_parameters()}
    rule = WorkerUpdate(params, PSConfig(update=DeltaUpdate()), num_workers=3, optimizer=opt)
    rule.rebase()
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1)) * 10
    (m(x).pow(2).sum() / 24).backward()  # this worker's share of a global batch of 24
    local_mean = [3 * p.grad.clone() for p in m.parameters()]
    norm = float(torch.stack([g.pow(2).sum() for g in local_mean]).sum().sqrt())
    assert norm > 2  # (well above the clip: clipped)
    update = rule.make()
    for (name, _), g in zip(m.named_parameters(), local_mean, strict=True):
        torch.testing.assert_close(update[name], -g * (0.5 / (norm + 1e-6)) / 3, rtol=1e-5, atol=1e-7)
