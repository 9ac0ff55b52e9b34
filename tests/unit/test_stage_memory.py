"""What a stage holds: the profiler's saved-tensor figures (``ModelProfile.held_bytes``), and the
stage's own measurement against its device's budget (``roles/stage_memory.py``)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from flotilla.core.errors import ConfigError, OutOfMemory
from flotilla.pipeline.instrument import SavedBytes, StageResult, saved_hooks
from flotilla.pipeline.profile import LayerProfile, ModelProfile
from flotilla.pipeline.profiler import profile_model
from flotilla.pipeline.stash import WeightStash
from flotilla.roles.stage_memory import StageMemory


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    # (Tanh keeps its output; Flatten's output is a view of it, which the next Linear keeps)
    return nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Flatten(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4)
    )


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


@pytest.mark.parametrize("ends", [(2, 6), (1, 3, 6), (3, 6), (2, 4, 6), (5, 6)])
def test_the_profiles_held_bytes_equal_what_a_stage_saves_at_run_time(ends: tuple[int, ...]) -> None:
    model, x = _model(), torch.randn(8, 16)
    profile = profile_model(model, x, _loss, num_warmup=0, num_repeats=1)
    assert all(layer.saved_bytes is not None for layer in profile.layers)
    assert profile.layers[2].aliases_input and not profile.layers[3].aliases_input
    start = 0
    for k in ends:  # each stage run alone, counted as the stage runtime counts (instrument.SavedBytes)
        stage = model[start:k]
        inp = x if start == 0 else model[:start](x).detach().requires_grad_()
        counter = SavedBytes({p.untyped_storage().data_ptr() for p in stage.parameters()})
        with saved_hooks(counter):
            out = stage(inp)
            if k == len(model):
                out = _loss(out)
        counter.add(out)
        if start > 0:
            counter.add(inp)
        loss = out.untyped_storage().nbytes() if k == len(model) else 0  # (the plan leaves out the loss)
        assert profile.held_bytes(start, k) + loss == counter.total, (start, k)
        start = k


def test_without_measured_fields_a_stage_holds_its_input_and_outputs() -> None:
    profile = ModelProfile.uniform(3, activation_bytes=100, batch_size=4)
    assert profile.held_bytes(1, 3) == 100 + 200


def test_the_held_fields_travel_in_the_profile_json_and_old_files_still_load() -> None:
    layer = LayerProfile(name="a", forward_s=0.1, backward_s=0.2, activation_bytes=8, param_bytes=4,
                         saved_bytes=12, keeps_input=False, keeps_output=True)  # fmt: skip
    profile = ModelProfile(layers=(layer,), batch_size=2)
    assert ModelProfile.from_dict(profile.to_dict()) == profile
    old = profile.to_dict()
    for key in ("saved_bytes", "keeps_input", "keeps_output", "aliases_input"):
        del old["layers"][0][key]
    assert ModelProfile.from_dict(old).layers[0].saved_bytes is None
    with pytest.raises(ConfigError, match="saved_bytes must be an integer number of bytes >= 0"):
        LayerProfile(name="a", forward_s=0, backward_s=0, activation_bytes=0, param_bytes=0, saved_bytes=-1)


def _runtime(activations: int) -> SimpleNamespace:
    module = nn.Linear(8, 8)  # 72 parameters: 288 bytes
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module(torch.randn(2, 8)).sum().backward()
    opt.step()  # (momentum buffers: 288 bytes)
    opt.zero_grad(set_to_none=True)
    result = StageResult(stage_idx=0)
    result.peak_activation_bytes = activations
    return SimpleNamespace(
        module=module, optimizer=opt, stash=WeightStash(list(module.parameters())), result=result
    )


def test_a_stage_measures_weights_gradients_state_and_activations() -> None:
    memory = StageMemory(_runtime(1000), budget_bytes=10_000, mode="fail", name="s0")  # type: ignore[arg-type]
    memory.check()
    assert memory.figures() == {
        "activation_bytes": 1000,
        "weight_bytes": 3 * 288,  # weights, a gradient each (freed between steps), momentum
        "peak_bytes": 1000 + 3 * 288,
        "budget_bytes": 10_000,
    }


def test_over_its_budget_a_stage_fails_in_one_line_or_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(OutOfMemory) as err:
        StageMemory(_runtime(5000), budget_bytes=4096, mode="fail", name="slow").check()  # type: ignore[arg-type]
    line = str(err.value)
    assert "\n" not in line and line.startswith("stage 'slow' holds 5.7 KiB (5864 bytes")
    assert "over its device's budget of 4.0 KiB" in line and "strategy.memory_check: fail" in line
    warn = StageMemory(_runtime(5000), budget_bytes=4096, mode="warn", name="slow")  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        warn.check()
        warn.check()
    assert sum("over its device's budget" in r.getMessage() for r in caplog.records) == 1
    StageMemory(_runtime(5000), budget_bytes=1, mode="off", name="slow").check()  # type: ignore[arg-type]


def test_memory_check_reads_a_bare_off_and_leaves_the_checkpoint_fingerprint_alone(tmp_path) -> None:
    from pathlib import Path

    from flotilla.config import load_config

    example = Path(__file__).parents[2] / "examples" / "pipeline_lm.yaml"
    plain = load_config(example, [])
    off = tmp_path / "off.yaml"
    off.write_text(
        example.read_text().replace("  step_timeout_s: 60.0", "  step_timeout_s: 60.0\n  memory_check: off")
    )
    assert load_config(off, []).strategy.memory_check == "off"
    assert plain.strategy.memory_check == "warn"
    assert load_config(example, ["strategy.memory_check=fail"]).fingerprint() == plain.fingerprint()
    with pytest.raises(ConfigError, match="strategy.memory_check: unknown 'maybe'; allowed: warn, fail, off"):
        load_config(example, ["strategy.memory_check=maybe"])


def test_counting_saved_tensors_leaves_no_reference_cycle() -> None:
    """A pass dropped without its backward is freed at once, as without the counting hooks: the
    pack hook keeps a *detached* tensor (the tensor itself makes a saved output hold its own
    grad_fn, pytorch#115255), and the gradients are the same."""
    import gc
    import weakref

    x = torch.randn(64, requires_grad=True)
    gc.disable()
    try:
        counter = SavedBytes(set())
        with saved_hooks(counter):
            y = torch.exp(x)  # (exp saves its output)
        alive = weakref.ref(y)
        del y
        assert alive() is None, "the saved output kept itself alive"
    finally:
        gc.enable()
    assert counter.total > 0
    with saved_hooks(SavedBytes(set())):
        counted = torch.autograd.grad(torch.exp(x).sigmoid().sum(), x)[0]
    plain = torch.autograd.grad(torch.exp(x).sigmoid().sum(), x)[0]
    assert torch.equal(counted, plain)
