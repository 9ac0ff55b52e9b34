"""The model gallery (``_gallery_tasks.py``) under the data-parallel strategies, with real
processes on 127.0.0.1: each model trains briefly, its exported ``model.safetensors`` loads
(``strict=True``) into a freshly built model and reproduces the reported test metrics; under
``allreduce`` the replicas' digests (parameters AND buffers) agree at every committed step."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
from safetensors.torch import load_file

import flotilla
from flotilla.trainer.task_load import TaskData, evaluate_task, load_task
from tests.multiproc._jobs import records, training_steps

pytestmark = pytest.mark.timeout(240)

TASKS = Path(__file__).with_name("_gallery_tasks.py")

ALLREDUCE = {
    "cluster": {"workers": [{"name": "w0"}, {"name": "w1"}, {"name": "w2"}], "host": "127.0.0.1"},
    "job": {"optimizer": {"kind": "adam", "lr": 0.01}, "batch_size": 48, "steps": 12, "seed": 0},
    "strategy": {"kind": "allreduce", "step_timeout_s": 60},
    "report": {"digest_every_steps": 1},
}
PS = {
    "cluster": {"workers": [{"name": "w0"}, {"name": "w1"}, {"name": "w2"}], "host": "127.0.0.1"},
    "job": {"optimizer": {"kind": "adam", "lr": 0.01}, "batch_size": 48, "steps": 12, "seed": 0},
    "strategy": {"kind": "ps", "num_servers": 2, "update": "delta", "consistency": {"kind": "bsp"}},
    "report": {"digest_every_steps": 0},
}


def _train(base: dict, name: str, tmp_path: Path, extra_job: dict | None = None) -> dict:
    cfg = json.loads(json.dumps(base))
    cfg["job"].update({"task": f"{TASKS}:{name}", "task_args": {}, **(extra_job or {})})
    summary = flotilla.run(cfg, report_dir=tmp_path / "report", run_dir=tmp_path / "run")
    assert summary["completed"]
    task = load_task(f"{TASKS}:{name}", {})
    model = task.build_model()
    model.load_state_dict(load_file(summary["model_file"]), strict=True)
    again = evaluate_task(task, model, TaskData(task.eval_data()))
    assert again["loss"] == pytest.approx(summary["test_loss"], rel=1e-5)
    assert again["accuracy"] == pytest.approx(summary["test_accuracy"], abs=1e-9)
    return summary


def _digests_per_step(report: Path) -> dict[int, set[str]]:
    by_step: dict[int, set[str]] = defaultdict(set)
    for r in training_steps(records(report)):
        if r.get("committed") and "digest" in r:
            by_step[r["step"]].add(r["digest"])
    return by_step


def test_a_batchnorm_model_under_allreduce_has_one_digest_per_committed_step(tmp_path: Path) -> None:
    _train(ALLREDUCE, "BatchNormMLP", tmp_path)
    by_step = _digests_per_step(tmp_path / "report")
    assert sorted(by_step) == list(range(12))
    assert all(len(d) == 1 for d in by_step.values()), {s: len(d) for s, d in by_step.items()}
    recs = [r for r in training_steps(records(tmp_path / "report")) if "digest" in r]
    assert len({r["worker_id"] for r in recs}) == 3


@pytest.mark.parametrize(
    "name", ["FrozenExtractor", "ParamFree", "TokenLM", "TiedLM", "DictInputs", "AuxOutput"]
)
def test_gallery_models_train_under_allreduce(name: str, tmp_path: Path) -> None:
    _train(ALLREDUCE, name, tmp_path)
    assert all(len(d) == 1 for d in _digests_per_step(tmp_path / "report").values())


@pytest.mark.parametrize("name", ["BatchNormMLP", "TiedLM", "DictInputs", "AuxOutput"])
def test_gallery_models_train_under_ps(name: str, tmp_path: Path) -> None:
    _train(PS, name, tmp_path)
