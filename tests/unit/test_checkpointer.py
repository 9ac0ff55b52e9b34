"""The one checkpointer (``trainer/checkpointer.py``): replicas and stages write one layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from flotilla.elastic.checkpoint import CheckpointError, latest_checkpoint
from flotilla.trainer.checkpointer import Checkpointer, CheckpointPlan, load_into


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
    return model, opt


def test_a_checkpoint_loads_back_bitwise_with_the_writers_fields_and_rng(tmp_path: Path) -> None:
    model, opt = _trained(0)
    plan = CheckpointPlan(directory=tmp_path / "stage1", keep=2, fingerprint="f")
    writer = Checkpointer(plan, meta=lambda step: {"stage_idx": 1, "losses": [0.5] * step}, rng=True)
    writer.write(3, model, opt, scheduler={"last_epoch": 3}, strategy={"m": torch.ones(2)})
    expected_draw = torch.rand(4)  # the RNG state was saved before this draw

    ckpt = latest_checkpoint(tmp_path / "stage1", fingerprint="f")
    assert set(ckpt.parts) == {"model", "optim", "strategy", "rng"}
    assert (
        ckpt.meta["stage_idx"] == 1
        and ckpt.meta["losses"] == [0.5] * 3
        and ckpt.scheduler == {"last_epoch": 3}
    )
    other, other_opt = _trained(1)
    assert load_into(ckpt, other, other_opt) == 3
    assert torch.equal(torch.rand(4), expected_draw)
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg"], other_opt.state[b]["exp_avg"])


def test_a_checkpoint_of_another_model_is_one_line_and_loads_nothing(tmp_path: Path) -> None:
    model, opt = _trained(0)
    Checkpointer(CheckpointPlan(directory=tmp_path, keep=1, fingerprint="f")).write(1, model, opt)
    ckpt = latest_checkpoint(tmp_path, fingerprint="f")
    assert "rng" not in ckpt.parts
    small = nn.Sequential(nn.Linear(4, 2))
    before = [p.detach().clone() for p in small.parameters()]
    with pytest.raises(CheckpointError) as err:
        load_into(ckpt, small, torch.optim.SGD(small.parameters(), lr=0.1))
    assert "does not fit this model" in str(err.value) and "\n" not in str(err.value)
    assert all(torch.equal(a, b) for a, b in zip(before, small.parameters(), strict=True))


def test_without_a_plan_nothing_is_written() -> None:
    model, opt = _trained(0)
    writer = Checkpointer(None)
    assert not writer.enabled and writer.directory is None
    with pytest.raises(CheckpointError):
        writer.write(1, model, opt)


def test_a_background_checkpoint_holds_the_state_of_its_step_not_what_training_did_after(
    tmp_path: Path,
) -> None:
    model, opt = _trained(0)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    moment = {id(p): opt.state[p]["exp_avg"].clone() for p in model.parameters()}
    writer = Checkpointer(CheckpointPlan(directory=tmp_path, keep=2, fingerprint="f"), background=True)
    path = writer.write(7, model, opt, strategy={"m": torch.ones(2)})
    with torch.no_grad():  # training goes on while the thread writes
        for p in model.parameters():
            p.add_(1.0)
            opt.state[p]["exp_avg"].mul_(0.0)
    writer.flush()
    ckpt = latest_checkpoint(tmp_path, fingerprint="f")
    assert ckpt.path == path and ckpt.meta["step"] == 7
    other, other_opt = _trained(1)
    assert load_into(ckpt, other, other_opt) == 7
    for key, value in other.state_dict().items():
        assert torch.equal(value, expected[key]), key
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(other_opt.state[q]["exp_avg"], moment[id(p)])


def test_a_background_write_that_fails_raises_at_the_next_flush_and_write(tmp_path: Path) -> None:
    model, opt = _trained(0)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoints should go")
    writer = Checkpointer(CheckpointPlan(directory=blocker, keep=1, fingerprint="f"), background=True)
    writer.write(1, model, opt)  # (returns: the failure happens in the thread)
    with pytest.raises(OSError):
        writer.flush()
    writer.flush()  # (raised once)
    writer.write(2, model, opt)
    with pytest.raises(OSError):
        writer.write(3, model, opt)  # the failure of step 2's write, raised before step 3's starts
    assert blocker.read_text().startswith("a file")


def test_background_writes_one_at_a_time_keep_the_newest(tmp_path: Path) -> None:
    model, opt = _trained(0)
    writer = Checkpointer(CheckpointPlan(directory=tmp_path, keep=2, fingerprint="f"), background=True)
    for step in range(1, 6):
        writer.write(step, model, opt)
    writer.flush()
    assert [p.name for p in sorted(tmp_path.glob("ckpt-*"))] == ["ckpt-000000004", "ckpt-000000005"]
    assert not list(tmp_path.glob(".ckpt-*"))
