"""A model that is not an nn.Sequential -- written like the transformers library's GPT-2
(``examples/own_task/gpt.py``: embeddings, a ModuleList of blocks, a final norm, a head tied to
the token embedding) -- trained by the pipeline strategy, one real process per stage.

- GPipe with 2 stages cut at a named block and 1F1B with 3 stages chosen by the partitioner from
  the traced layers give the single-process reference's losses (the user's untraced model, the
  same data order) within float tolerance, and ``model.safetensors`` loads with ``strict=True``
  into the user's own class and reproduces the reported test metrics;
- PipeDream trains the untied variant; with the tie it is refused in one line before anything
  starts (its asynchronous schedule has no flush at which the stages could keep the tie).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flotilla.config import RunConfig, load_config
from flotilla.core.errors import ConfigError
from flotilla.launch.pipeline import run_pipeline_job
from flotilla.trainer import builders
from flotilla.trainer.reference import train_single_process
from flotilla.trainer.task_load import evaluate_task

ROOT = Path(__file__).resolve().parents[2]
GPT_FILE = ROOT / "examples/own_task/gpt.py"
ARGS = "{vocab: 16, seq_len: 8, dim: 16, layers: 3, heads: 2, num_samples: 600, tied: TIED}"


def _cfg(tmp_path: Path, stages: int, strategy: str, tied: bool = True) -> RunConfig:
    workers = ", ".join(f"{{name: s{i}}}" for i in range(stages))
    path = tmp_path / "gpt.yaml"
    path.write_text(
        f"""
cluster: {{workers: [{workers}]}}
job:
  task: "{GPT_FILE}:TinyGPT"
  task_args: {ARGS.replace("TIED", str(tied).lower())}
  optimizer: {{kind: sgd, lr: 0.1, momentum: 0.9}}
  batch_size: 32
  steps: 10
strategy: {{kind: pipeline, num_stages: {stages}, num_microbatches: 4, step_timeout_s: 30, {strategy}}}
"""
    )
    return load_config(path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return train_single_process(_cfg(tmp_path_factory.mktemp("ref"), 1, "schedule: gpipe"))


def _user_class():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("user_gpt_mp", GPT_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GPT2LMHead


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("stages", "strategy"),
    [(2, 'schedule: gpipe, split_points: ["transformer.h.2"]'), (3, "schedule: 1f1b")],
    ids=["gpipe-2-named", "1f1b-3-partitioned"],
)
def test_a_gpt2_style_model_trains_as_a_pipeline_like_one_process(
    tmp_path: Path, reference: list[float], stages: int, strategy: str
) -> None:
    cfg = _cfg(tmp_path, stages, strategy)
    summary = run_pipeline_job(cfg, tmp_path / "report", tmp_path / "run", False)
    assert len(summary["train_losses"]) == 10
    assert summary["train_losses"] == pytest.approx(reference, rel=1e-4)
    assert summary["train_losses"][-1] < summary["train_losses"][0]
    model = _user_class()(vocab=16, seq_len=8, dim=16, layers=3, heads=2)  # the user's own class
    model.load_state_dict(load_file(summary["model_file"]), strict=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    task = builders.build_task(cfg)
    _, eval_data = builders.build_task_data(task)
    again = evaluate_task(task, model, eval_data)
    assert again["loss"] == pytest.approx(summary["test_loss"], rel=1e-6)
    assert again["accuracy"] == pytest.approx(summary["test_accuracy"], abs=1e-9)


@pytest.mark.timeout(120)
def test_pipedream_trains_the_untied_variant_and_refuses_the_tie_before_starting(tmp_path: Path) -> None:
    tied = _cfg(tmp_path, 2, 'schedule: pipedream, split_points: ["transformer.h.1"]')
    with pytest.raises(ConfigError, match="tied across stages 0, 1.*use schedule gpipe or 1f1b"):
        run_pipeline_job(tied, tmp_path / "r0", tmp_path / "run0", False)
    assert not (tmp_path / "run0").exists() or not any((tmp_path / "run0").glob("stage*.json"))
    cfg = _cfg(tmp_path, 2, 'schedule: pipedream, split_points: ["transformer.h.1"]', tied=False)
    summary = run_pipeline_job(cfg, tmp_path / "report", tmp_path / "run", False)
    losses = summary["train_losses"]
    assert len(losses) == 10 and all(torch.isfinite(torch.tensor(losses)))
    assert summary["completed"] and losses[-1] < losses[0]
    model = _user_class()(vocab=16, seq_len=8, dim=16, layers=3, heads=2, tied=False)
    model.load_state_dict(load_file(summary["model_file"]), strict=True)
