"""Pipeline layers of a model that is not an nn.Sequential (``pipeline/trace.py``): a GPT-2-style
model (``examples/own_task/gpt.py``: embeddings, a ModuleList of blocks, a final norm, a tied head)
traced and cut at named modules.

- the layers reproduce the model's output and gradients bitwise and hold its own parameters, so
  the user's untraced model carries every weight the layers were trained to;
- without split points every block boundary is a cut; a tie across stages is found by the
  existing tie rule (kept by flushing schedules, refused for pipedream);
- what cannot be cut or traced is refused in one line naming the point or the module;
- the run configuration's ``strategy.split_points`` reaches the layers (``pipeline_parts``), and a
  bad point is refused by ``validate`` before anything starts.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from flotilla.config import load_config
from flotilla.core.errors import ConfigError
from flotilla.launch.validation import validate
from flotilla.pipeline.model_check import check_layers, refuse_split_ties, split_ties
from flotilla.pipeline.profiler import layer_names
from flotilla.pipeline.split import split_sequential
from flotilla.pipeline.trace import cut_candidates, trace_layers
from flotilla.trainer.pipeline_setup import pipeline_parts

ROOT = Path(__file__).resolve().parents[2]
GPT_FILE = ROOT / "examples/own_task/gpt.py"


def _gpt_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("user_gpt", GPT_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["user_gpt"] = module
    spec.loader.exec_module(module)
    return module


GPT = _gpt_module()


def _model(**kw: object) -> nn.Module:
    torch.manual_seed(0)
    return GPT.GPT2LMHead(vocab=16, seq_len=8, dim=16, layers=3, heads=2, **kw)


def _ids(n: int = 5) -> torch.Tensor:
    return torch.randint(0, 16, (n, 8), generator=torch.Generator().manual_seed(1))


def test_the_layers_reproduce_the_models_output_and_gradients_bitwise() -> None:
    model = _model()
    layers = trace_layers(model, ["transformer.h.1", "transformer.h.2"])
    assert len(layers) == 3
    ids = _ids()
    for mode in (True, False):
        model.train(mode)
        layers.train(mode)
        assert torch.equal(layers(ids), model(ids))
    model.train()
    F.cross_entropy(model(ids).reshape(-1, 16), ids.reshape(-1)).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    F.cross_entropy(layers(ids).reshape(-1, 16), ids.reshape(-1)).backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, expected[name]), name


def test_the_layers_hold_the_models_own_parameters_so_the_user_class_gets_the_trained_weights() -> None:
    model = _model()
    layers = trace_layers(model, ["transformer.h.2"])
    assert {id(p) for p in layers.parameters()} == {id(p) for p in model.parameters()}
    with torch.no_grad():
        for p in split_sequential(layers, [1, 2])[1].parameters():
            p.add_(1.0)  # "training" stage 1
    fresh = _model()
    fresh.load_state_dict(model.state_dict(), strict=True)
    ids = _ids()
    assert torch.equal(fresh(ids), layers(ids))
    assert not torch.equal(_model()(ids), layers(ids))


def test_without_split_points_every_block_boundary_is_a_cut_in_forward_order() -> None:
    model = _model()
    points = cut_candidates(model)
    blocks = [f"transformer.h.{i}" for i in range(3)]
    assert [p for p in points if p in blocks] == blocks
    assert points[-1] == "lm_head" and "transformer.ln_f" in points
    layers = trace_layers(model)
    assert len(layers) == len(points) + 1
    assert layer_names(layers)[:2] == ["0:transformer", f"1:{points[0]}"]
    check_layers(layers, _ids())  # every layer but the last: one tensor, batch first
    ids = _ids()
    assert torch.equal(layers(ids), model(ids))


def test_a_head_tied_to_the_embedding_is_a_tie_across_stages() -> None:
    layers = trace_layers(_model(), ["transformer.h.1", "transformer.h.2"])
    (tie,) = split_ties(layers, [1, 2, 3])
    assert tie.stages == (0, 2) and tie.name.endswith("transformer.wte.weight")
    with pytest.raises(ConfigError, match="tied across stages 0, 2.*use schedule gpipe or 1f1b"):
        refuse_split_ties(layers, [1, 2, 3], "pipedream")
    assert split_ties(trace_layers(_model(tied=False), ["transformer.h.1"]), [1, 2]) == []


class _Constant(nn.Module):
    """A tensor made in ``forward``: fx keeps it as a constant of the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) + torch.ones(4))


def test_a_tensor_made_in_forward_is_kept_and_the_users_model_left_clean() -> None:
    model = _Constant()
    layers = trace_layers(model, ["b"])
    x = torch.randn(3, 4)
    assert torch.equal(layers(x), model(x))
    assert not [k for k in vars(model) if k.startswith("_tensor_constant")]  # (the trace's own)


class _TupleDefault(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, dims: tuple[int, int] = (1, 0)) -> torch.Tensor:
        return self.lin(x).permute(*dims)


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _ValueBranch()
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))


class _ValueBranch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # control flow on a tensor's value
            return x
        return -x


class _FunctionalDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.lin(x), 0.1, self.training)


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + y


@pytest.mark.parametrize(
    ("points", "match"),
    [
        (["transformer.h.7"], r"'transformer.h.7' names no module GPT2LMHead calls \(points where one tensor "
         r"crosses: transformer.drop, transformer.h.0"),
        (["transformer.h.0.attn.c_proj"], r"'transformer.h.0.attn.c_proj': 2 values cross it"),
        (["transformer.h.2", "transformer.h.1"], r"'transformer.h.1' must come after the one before it"),
        (["transformer.h.1", "transformer.h.1"], r"split points must differ"),
        (["transformer.wte"], r"'transformer.wte': 2 values cross it \(input_ids, "),
    ],
)  # fmt: skip
def test_a_point_that_cannot_be_cut_is_refused_naming_it(points: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        trace_layers(_model(), points, where="job.task: x")


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (_Branches(), r"_Branches cannot be traced for a pipeline \(module inner\): TraceError: "),
        (_FunctionalDropout(), r"changes with self.training outside a torch.nn module"),
        (_TwoInputs(), r"takes a second input 'y' without a default"),
        (_TupleDefault(), r"has a default that is a tuple, list or dict"),
    ],
)
def test_a_model_that_cannot_be_traced_is_refused_naming_the_module(model: nn.Module, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        trace_layers(model)


def test_an_nn_sequential_with_split_points_is_cut_there() -> None:
    seq = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    layers = trace_layers(seq, ["2", "4"])
    assert len(layers) == 3
    x = torch.randn(3, 4)
    assert torch.equal(layers(x), seq(x))


CONFIG = f"""
cluster: {{workers: [{{name: a}}, {{name: b}}]}}
job:
  task: "{GPT_FILE}:TinyGPT"
  task_args: {{vocab: 16, seq_len: 8, dim: 16, layers: 3, heads: 2, num_samples: 200}}
  batch_size: 16
  steps: 2
strategy: {{kind: pipeline, schedule: gpipe, num_stages: 2, num_microbatches: 2{{points}}}}
"""


def _cfg(tmp_path: Path, points: str = ""):  # type: ignore[no-untyped-def]
    path = tmp_path / "gpt.yaml"
    path.write_text(CONFIG.replace("{points}", points))
    return load_config(path)


def test_the_configs_split_points_reach_the_layers_and_the_source_model(tmp_path: Path) -> None:
    parts = pipeline_parts(_cfg(tmp_path, ', split_points: ["transformer.h.2"]'))
    assert len(parts.model) == 2
    assert type(parts.source).__name__ == "GPT2LMHead"  # (the task file is loaded under its own name)
    assert {id(p) for p in parts.model.parameters()} == {id(p) for p in parts.source.parameters()}
    auto = pipeline_parts(_cfg(tmp_path))
    assert len(auto.model) == len(cut_candidates(auto.source)) + 1


def test_validate_refuses_a_bad_split_point_naming_the_task_and_the_point(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, ', split_points: ["transformer.h.9"]')
    match = r"job.task: .*gpt.py:TinyGPT: split point 'transformer.h.9' names no"
    with pytest.raises(ConfigError, match=match):
        validate(cfg)
