"""job.task / checkpoint configuration, and the launcher's checks before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flotilla.config import load_config
from flotilla.core.errors import ConfigError, FlotillaError
from flotilla.elastic.checkpoint import write_checkpoint
from flotilla.launch.prepare import check_job_task, job_files
from flotilla.launch.validation import check_host, validate, validate_plan
from flotilla.trainer.builders import worker_device

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


@pytest.mark.parametrize(
    "example", ["tiny", "ps_ssp", "partial_reduce", "adpsgd", "diloco", "adaptive", "pipeline_lm"]
)
def test_every_strategy_validates_with_its_workers_on_cuda(example: str) -> None:
    """Issue 34: each built-in strategy declares a GPU path; whether CUDA is there is the host
    check's business (``flotilla run``), not the configuration's."""
    cfg = load_config(ROOT / f"examples/{example}.yaml", ["cluster.defaults.device=cuda"])
    assert cfg.launch_plan().gpu
    validate_plan(cfg)
    assert {w.device for w in cfg.cluster.resolved_workers()} == {"cuda"}


def test_a_strategy_without_a_gpu_path_refuses_cuda_workers_before_anything_starts() -> None:
    cfg = load_config(ROOT / "examples/own_strategy/averaged.yaml", ["cluster.defaults.device=cuda"])
    with pytest.raises(ConfigError, match="has device cuda; strategy .* runs on cpu only"):
        validate_plan(cfg)


def test_a_device_class_is_a_label_and_device_says_where_a_worker_computes() -> None:
    """``type: V100`` is emulated on the CPU; ``type: cuda`` (no ``device``) computes on a GPU;
    an explicit ``device`` wins over both."""
    cfg = load_config(
        ROOT / "examples/tiny.yaml",
        [
            "cluster.num_workers=null",
            "cluster.workers=[{name: a, type: V100}, {name: b, type: cuda},"
            " {name: c, type: cuda, device: cpu}, {name: d, type: V100, device: cuda}]",
        ],
    )
    assert [(w.name, w.device) for w in cfg.cluster.resolved_workers()] == [
        ("a", "cpu"),
        ("b", "cuda"),
        ("c", "cpu"),
        ("d", "cuda"),
    ]
    assert worker_device(cfg, "a") == torch.device("cpu") and worker_device(cfg, "c") == torch.device("cpu")
    assert cfg.cluster.worker("spot-1").device == "cpu"  # (a name only a revocation adds: the defaults)


def test_a_gpu_worker_without_cuda_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    cfg = load_config(ROOT / "examples/tiny.yaml", ["cluster.defaults.type=cuda"])
    validate(cfg)  # a configuration for a machine with a GPU: valid (launch/validation.py)
    with pytest.raises(ConfigError, match="has no usable CUDA device"):
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
