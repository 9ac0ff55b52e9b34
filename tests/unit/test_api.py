"""The public Python surface: flotilla.make_config and how flotilla.run names a task object."""

from __future__ import annotations

from pathlib import Path

import pytest

import flotilla
from flotilla.api import _with_task
from flotilla.core.errors import ConfigError
from flotilla.trainer.task_load import load_task

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples/tiny.yaml"


def test_make_config_from_path_mapping_and_config_repeatedly() -> None:
    for _ in range(2):  # the lazy re-export must survive the config subpackage being imported
        from_path = flotilla.make_config(TINY, ["job.steps=7"])
        assert isinstance(from_path, flotilla.RunConfig) and from_path.job.steps == 7
        again = flotilla.make_config(from_path.to_dict())
        assert again == from_path
        assert flotilla.make_config(again, ["job.seed=3"]).job.seed == 3


def test_make_config_names_the_bad_field() -> None:
    with pytest.raises(ConfigError, match="job.optimizer.lr"):
        flotilla.make_config(TINY, ["job.optimizer.lr=-1"])


def test_a_task_instance_is_sent_as_its_file_and_recorded_arguments() -> None:
    task = load_task("examples/own_task/task.py:Spirals", {"width": 8, "depth": 1}, base_dir=ROOT)
    cfg = _with_task(flotilla.make_config(TINY), (), task, None)
    name, args = cfg.job.task_spec()
    assert name == f"{(ROOT / 'examples/own_task/task.py').resolve()}:Spirals"
    assert args == {"width": 8, "depth": 1}
    assert cfg.job.model is None and cfg.job.dataset is None


def test_a_plain_task_instance_needs_its_arguments() -> None:
    class Plain:  # has the methods, records nothing
        def build_model(self): ...
        def train_data(self): ...
        def eval_data(self): ...
        def loss(self, o, t): ...
        def metrics(self, o, t): ...

    with pytest.raises(ConfigError, match="pass task_args="):
        _with_task(flotilla.make_config(TINY), (), Plain(), None)


def test_a_config_without_a_task_of_its_own_takes_run_s_task(tmp_path: Path) -> None:
    """The module doc's example: a mapping (or a file) with no ``job.task`` / ``job.model``, the
    task given to ``flotilla.run`` (it failed validation before the task was put in)."""
    task = load_task("examples/own_task/task.py:Spirals", {"width": 8}, base_dir=ROOT)
    mapping = {
        "cluster": {"num_workers": 2},
        "job": {"batch_size": 16, "steps": 3},
        "strategy": {"kind": "allreduce"},
    }
    file = tmp_path / "job.yaml"
    file.write_text(
        "cluster: {num_workers: 2}\njob: {batch_size: 16, steps: 3}\nstrategy: {kind: allreduce}\n"
    )
    for source in (mapping, file):
        cfg = _with_task(source, ["job.steps=5"], task, None)
        assert cfg.job.task_spec() == (
            f"{(ROOT / 'examples/own_task/task.py').resolve()}:Spirals",
            {"width": 8},
        )
        assert cfg.job.steps == 5 and cfg.job.model is None
    with pytest.raises(ConfigError, match="job.model"):  # (without a task: the config must name one)
        flotilla.make_config(mapping)
