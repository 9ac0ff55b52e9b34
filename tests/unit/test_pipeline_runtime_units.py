"""Units of the pipeline runtime: weight stash, model split, profiler, the LM and its data, the
``profile``/``plan`` commands."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
from torch import nn
from typer.testing import CliRunner

from flotilla.cli.pipeline_cmds import plan_command, profile_command
from flotilla.core.errors import ConfigError
from flotilla.data.text import VOCAB, decode, encode, load_pysource, stdlib_text
from flotilla.models.zoo import build_model
from flotilla.pipeline.plan import DeviceSpec, LinkModel, PartitionOptions, PlanError, evaluate_plan
from flotilla.pipeline.profile import ModelProfile
from flotilla.pipeline.profiler import profile_model
from flotilla.pipeline.schedule import Backward, Forward, OptimizerStep, gpipe, one_f_one_b, pipedream
from flotilla.pipeline.split import boundary_specs, even_layer_ends, fixed_stage_plan, split_sequential
from flotilla.pipeline.stash import WeightStash, plan_stash
from flotilla.pipeline.validate import analyze

# ----------------------------------------------------------------------------------- stash

SCHEDULES = [
    gpipe(3, 4, 2),
    one_f_one_b(3, 4, 2),
    pipedream(2, 6),
    pipedream(3, 7),
    pipedream(4, 9),
    pipedream(3, 7, vertical_sync=True),
    pipedream(4, 9, vertical_sync=True),
]


def test_flush_schedules_never_stash_and_pipedream_stashes_all_but_the_first() -> None:
    for sched in SCHEDULES[:2]:
        assert all(not plan_stash(stage).stashed for stage in sched.stages)
    plans = [plan_stash(stage) for stage in pipedream(2, 6).stages]
    assert plans[0].stashed == frozenset(range(1, 6))  # F(b+1) runs before B(b)'s update
    assert plans[1].stashed == frozenset()  # last stage: F b, B b, update


@pytest.mark.parametrize(
    "schedule", SCHEDULES, ids=lambda s: f"{s.kind.value}-p{s.num_stages}-vs{int(s.vertical_sync)}"
)
def test_stash_serves_each_version_and_holds_only_what_the_schedule_needs(schedule) -> None:
    stats = analyze(schedule)
    for i, actions in enumerate(schedule.stages):
        param = nn.Parameter(torch.zeros(3))
        stash, plan = WeightStash([param]), plan_stash(actions)
        seen: dict[int, float] = {}
        for idx, a in enumerate(actions):
            if isinstance(a, OptimizerStep):
                stash.before_update(keep_current=plan.needed_after(a.reads_version, idx))
                with torch.no_grad():
                    param.add_(1.0)  # in place, like an optimizer: version v+1 holds v+1
                stash.after_update()
                continue
            if not isinstance(a, (Forward, Backward)):
                continue
            used = stash.tensors(a.weight_version)[0] if a.microbatch_idx in plan.stashed else param
            assert float(used[0].detach()) == a.weight_version, (i, a)
            if isinstance(a, Forward):
                seen[a.microbatch_idx] = float(used[0].detach())
            else:
                assert float(used[0].detach()) == seen[a.microbatch_idx]
            if plan.last_use[a.weight_version] == idx:
                stash.release(a.weight_version)
            stash.note_peak()
        assert stash.peak_copies == stats.peak_weight_versions[i]


def test_stash_refuses_a_dropped_version() -> None:
    stash = WeightStash([nn.Parameter(torch.zeros(2))])
    stash.before_update(keep_current=False)
    stash.after_update()
    with pytest.raises(ConfigError, match="version 0 is not stashed"):
        stash.tensors(0)


# ----------------------------------------------------------------------------------- split


def _lm(seq: int = 8, vocab: int = 12, width: int = 16) -> nn.Sequential:
    return build_model("char_transformer", input_shape=(seq,), num_classes=vocab, width=width, seed=3)


def test_split_shares_layers_and_composes_to_the_model() -> None:
    model = _lm()
    stages = split_sequential(model, (2, 5, 6))
    assert [len(s) for s in stages] == [2, 3, 1]
    assert [p for s in stages for p in s.parameters()] == list(model.parameters())
    x = torch.randint(0, 12, (3, 8))
    h = x
    for s in stages:
        h = s(h)
    torch.testing.assert_close(h, model(x), rtol=0, atol=0)
    specs = boundary_specs(model, x[:1], (2, 5, 6))
    assert [(s.shape, s.dtype) for s in specs] == [((8, 16), torch.float32)] * 2
    assert specs[0].bytes_for(4) == 4 * 8 * 16 * 4
    with pytest.raises(ConfigError, match="strictly increasing"):
        split_sequential(model, (3, 3, 6))
    assert even_layer_ends(6, 4) == (2, 4, 5, 6)


def test_fixed_stage_plan_is_the_best_split_and_gives_the_fast_device_more() -> None:
    profile = ModelProfile.uniform(6, forward_s=1.0, backward_s=2.0, activation_bytes=1000, param_bytes=100)
    devices = [
        DeviceSpec(name="fast", speed=1.0, memory_bytes=10**6),
        DeviceSpec(name="slow", speed=0.5, memory_bytes=10**6),
    ]
    opts = PartitionOptions(num_microbatches=1)
    plan = fixed_stage_plan(profile, devices, LinkModel(), opts)
    assert [s.layer_end - s.layer_start for s in plan.stages] == [4, 2]
    brute = min(
        (
            evaluate_plan(profile, devices, LinkModel(), opts, (k, 6), [("fast",), ("slow",)])
            for k in range(1, 6)
        ),
        key=lambda p: (p.bottleneck_s, p.total_stage_s),
    )
    assert plan.bottleneck_s == brute.bottleneck_s


def test_fixed_stage_plan_refuses_with_the_device_and_shortfall() -> None:
    profile = ModelProfile.uniform(4, activation_bytes=10, param_bytes=1000)
    devices = [DeviceSpec(name="a", memory_bytes=10**6), DeviceSpec(name="tiny", memory_bytes=100)]
    with pytest.raises(PlanError, match=r"device tiny needs .* short by"):
        fixed_stage_plan(profile, devices)


# ----------------------------------------------------------------------------------- profiler


def test_profiler_measures_each_layer_with_the_injected_clock() -> None:
    ticks = itertools.count()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    prof = profile_model(
        model,
        x,
        lambda out: nn.functional.cross_entropy(out, y),
        num_warmup=1,
        num_repeats=3,
        clock=lambda: float(next(ticks)),
    )
    assert [l.name for l in prof.layers] == ["0:Linear", "1:ReLU", "2:Linear"]
    assert all(l.forward_s == 1.0 and l.backward_s == 1.0 for l in prof.layers)  # one tick per timed call
    assert [l.activation_bytes for l in prof.layers] == [5 * 8 * 4, 5 * 8 * 4, 5 * 3 * 4]
    assert [l.param_bytes for l in prof.layers] == [(32 + 8) * 4, 0, (24 + 3) * 4]
    assert (prof.batch_size, prof.input_bytes) == (5, 5 * 4 * 4)
    assert all(p.grad is None for p in model.parameters())


def test_profiler_real_times_are_positive_and_round_trip(tmp_path: Path) -> None:
    model = _lm()
    x = torch.randint(0, 12, (4, 8))
    prof = profile_model(model, x, lambda out: nn.functional.cross_entropy(out, x), num_repeats=1)
    assert prof.num_layers == 6 and all(l.forward_s > 0 and l.backward_s > 0 for l in prof.layers[1:])
    assert ModelProfile.load(prof.save(tmp_path / "p.json")) == prof


# ----------------------------------------------------------------------------------- LM and data


def test_char_transformer_is_causal_and_deterministic() -> None:
    model, again = _lm(), _lm()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    x = torch.randint(0, 12, (2, 8))
    out = model(x)
    assert out.shape == (2, 12, 8)
    x2 = x.clone()
    x2[:, 5:] = (x2[:, 5:] + 1) % 12
    torch.testing.assert_close(model(x2)[:, :, :5], out[:, :, :5])
    assert not torch.allclose(model(x2)[:, :, 5:], out[:, :, 5:])


def test_pysource_windows_are_deterministic_next_character_pairs() -> None:
    data = load_pysource(num_samples=200, test_fraction=0.25, seq_len=16)
    again = load_pysource(num_samples=200, test_fraction=0.25, seq_len=16)
    assert data.x_train.shape == (150, 16) and data.x_test.shape == (50, 16)
    assert data.num_classes == len(VOCAB) == 96
    assert np.array_equal(data.x_train, again.x_train) and np.array_equal(data.y_test, again.y_test)
    assert np.array_equal(data.x_train[:, 1:], data.y_train[:, :-1])  # y is x shifted by one
    text = stdlib_text().replace("\t", "    ")
    assert "def " in text and "import " in text
    for row, nxt in zip(data.x_train[:20], data.y_train[:20, -1]):  # windows are pieces of the text
        assert decode([*row, nxt]).replace("?", "") in text.replace("?", "") or "?" in decode(row)
    assert decode(encode("a\tb\n~é")) == "a    b\n~?"


# ----------------------------------------------------------------------------------- commands

TINY = """
cluster:
  workers: [{name: fast, speed: 1.0, memory_bytes: 64MiB}, {name: slow, speed: 0.5, memory_bytes: 64MiB}]
job:
  model: {name: char_transformer, width: 32}
  dataset: {name: pysource, num_samples: 200, test_fraction: 0.2}
  batch_size: 8
  steps: 2
strategy: {kind: pipeline, schedule: 1f1b, num_stages: 2, num_microbatches: 2}
"""


def _cli() -> typer.Typer:
    app = typer.Typer(add_completion=False)
    app.command("profile")(profile_command)
    app.command("plan")(plan_command)
    return app


def test_profile_and_plan_commands(tmp_path: Path) -> None:
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    runner = CliRunner()
    res = runner.invoke(_cli(), ["profile", str(cfg), "--out", str(tmp_path / "prof.json")])
    assert res.exit_code == 0, res.output
    prof = json.loads((tmp_path / "prof.json").read_text())
    assert [l["name"] for l in prof["layers"]][:2] == ["0:CharEmbedding", "1:TransformerBlock"]
    res = runner.invoke(_cli(), ["plan", str(cfg), "--profile", str(tmp_path / "prof.json")])
    assert res.exit_code == 0, res.output
    assert "bottleneck: stage" in res.output and "flotilla run uses 2 stage(s)" in res.output
    res = runner.invoke(
        _cli(),
        [
            "plan",
            str(cfg),
            "--profile",
            str(tmp_path / "prof.json"),
            "--set",
            "cluster.workers.1.memory_bytes=1kB",
        ],
    )
    assert res.exit_code == 2
    assert "device slow needs" in res.output and "short by" in res.output
    res = runner.invoke(
        _cli(), ["plan", str(cfg), "--set", "strategy.num_stages=3", "--profile", str(tmp_path / "prof.json")]
    )
    assert res.exit_code == 2 and "must equal the number of cluster workers" in res.output
