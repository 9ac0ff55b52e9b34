"""job.task / checkpoint configuration, and the launcher's checks before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flotilla.config import load_config
from flotilla.core.errors import ConfigError, FlotillaError
from flotilla.elastic.checkpoint import write_checkpoint
from flotilla.launch.prepare import check_job_task, job_files
from flotilla.launch.validation import check_host, validate

ROOT = Path(__file__).resolve().parents[2]
TASK_JOB = [
    "job.model=null",
    "job.dataset=null",
    "job.task=examples/own_task/task.py:Spirals",
    "job.task_args={num_samples: 200, width: 8, depth: 1}",
    "job.steps=20",
    "job.epochs=null",
]


def _cfg(*extra: str):
    return load_config(ROOT / "examples/tiny.yaml", [*TASK_JOB, *extra])


def test_a_relative_task_file_is_made_absolute() -> None:
    name, args = _cfg().job.task_spec()
    assert name == f"{ROOT / 'examples/own_task/task.py'}:Spirals"
    assert args == {"num_samples": 200, "width": 8, "depth": 1}


def test_the_zoo_is_an_ordinary_task() -> None:
    name, args = load_config(ROOT / "examples/tiny.yaml").job.task_spec()
    assert name == "flotilla.trainer.zoo_tasks:ZooTask" and args["model"] == "tiny_mlp"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["job.task=examples/own_task/task.py:Spirals"], "job.task: set either task (your own) or model"),
        (["job.model=null"], "job.model: set task (your own task) or both model and dataset"),
        (["job.task_args={a: 1}"], "job.task_args: task_args needs task"),
        (["checkpoint.keep=2"], "checkpoint.every_steps: set every_steps, every_s or both"),
        (["checkpoint.every_steps=0"], "checkpoint.every_steps"),
    ],
)
def test_bad_task_and_checkpoint_configs_name_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(ROOT / "examples/tiny.yaml", overrides)
    assert message in str(info.value)


def test_fingerprint_ignores_the_run_length_but_not_the_optimizer() -> None:
    base = _cfg().fingerprint()
    assert _cfg("job.steps=999").fingerprint() == base
    assert _cfg("job.optimizer.lr=0.5").fingerprint() != base


def test_a_task_whose_model_does_not_fit_its_loss_stops_before_anything_starts(tmp_path: Path) -> None:
    bad = tmp_path / "bad_task.py"
    bad.write_text(
        "import torch\nfrom torch import nn\n"
        "class Bad:\n"
        "    def build_model(self): return nn.Linear(2, 1)\n"
        "    def train_data(self): return (torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))\n"
        "    def eval_data(self): return self.train_data()\n"
        "    def loss(self, o, t): return nn.functional.cross_entropy(o, t)\n"
        "    def metrics(self, o, t): return {}\n"
    )
    cfg = load_config(ROOT / "examples/tiny.yaml", [*TASK_JOB[:2], f"job.task={bad}:Bad", "job.steps=5"])
    with pytest.raises(ConfigError, match="loss\\(model\\(inputs\\), targets\\) failed"):
        check_job_task(cfg)


def _checkpoint(directory: Path, fingerprint: str, step: int = 5) -> None:
    write_checkpoint(
        directory, step=step, parts={"model": {"w": torch.zeros(1)}}, meta={}, fingerprint=fingerprint
    )


def test_resume_from_another_config_is_refused(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "ck", "someone-else")
    with pytest.raises(FlotillaError, match="written by another configuration"):
        job_files(_cfg(), output_dir=tmp_path, resume_dir=tmp_path / "ck", total_steps=20)


def test_resume_with_nothing_left_to_train_is_refused(tmp_path: Path) -> None:
    cfg = _cfg()
    _checkpoint(tmp_path / "ck", cfg.fingerprint(), step=20)
    with pytest.raises(ConfigError, match="nothing left to train"):
        job_files(cfg, output_dir=tmp_path, resume_dir=tmp_path / "ck", total_steps=20)


def test_a_fresh_run_does_not_overwrite_existing_checkpoints(tmp_path: Path) -> None:
    cfg = _cfg("checkpoint.every_steps=5", "checkpoint.dir=ck")
    _checkpoint(tmp_path / "ck", cfg.fingerprint())
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        job_files(cfg, output_dir=tmp_path, resume_dir=None, total_steps=20)
    files = job_files(cfg, output_dir=tmp_path / "elsewhere", resume_dir=None, total_steps=20)
    assert files["checkpoint_dir"] == str((tmp_path / "elsewhere" / "ck").resolve())


def test_gpu_workers_outside_allreduce_are_refused_before_anything_starts() -> None:
    cfg = load_config(ROOT / "examples/pipeline_lm.yaml", ["cluster.defaults.type=cuda", "job.steps=2"])
    with pytest.raises(ConfigError, match="strategy pipeline runs on cpu only"):
        validate(cfg)


def test_a_gpu_worker_without_cuda_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    cfg = load_config(ROOT / "examples/tiny.yaml", ["cluster.defaults.type=cuda"])
    validate(cfg)  # a configuration for a machine with a GPU: valid (launch/validation.py)
    with pytest.raises(ConfigError, match="has no CUDA device"):
        check_host(cfg)


def test_a_headline_the_evaluation_lacks_is_refused_before_anything_starts(tmp_path: Path) -> None:
    task = tmp_path / "reg_task.py"
    task.write_text(
        "import torch\nfrom torch import nn\n"
        "class Reg:\n"
        "    headline = ('rmse', 'min')\n"
        "    def build_model(self): return nn.Linear(2, 1)\n"
        "    def train_data(self): return (torch.zeros(4, 2), torch.zeros(4, 1))\n"
        "    def eval_data(self): return self.train_data()\n"
        "    def loss(self, o, t): return nn.functional.mse_loss(o, t)\n"
        "    def metrics(self, o, t): return {'mse': float(nn.functional.mse_loss(o, t))}\n"
    )
    cfg = load_config(ROOT / "examples/tiny.yaml", [*TASK_JOB[:2], f"job.task={task}:Reg", "job.steps=5"])
    with pytest.raises(ConfigError, match="headline 'rmse' is not one of its evaluation results"):
        check_job_task(cfg)
