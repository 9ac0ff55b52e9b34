"""One validation (issue 37, ``launch/validation.py``): ``flotilla run`` makes exactly the
configuration-level checks ``flotilla validate`` makes, through the same functions, and no other
before it starts; what the machine must provide (CUDA) is a separate host check, so a
configuration written for another machine validates here."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flotilla.cli.main import app
from flotilla.config import load_config
from flotilla.core.errors import ConfigError
from flotilla.launch import validation

from ._source import SRC, names_in

ROOT = Path(__file__).resolve().parents[2]

# The checks that only launch/validation.py may call on the way to a run.
CONFIG_CHECKS = {"check_job_task", "refusal", "pipeline_parts", "worker_device", "sequential_model"}

NOT_SEQUENTIAL = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Task:
    def build_model(self):
        return Net()

    def train_data(self):
        g = torch.Generator().manual_seed(0)
        return torch.randn(64, 2, generator=g), torch.randint(0, 3, (64,), generator=g)

    def eval_data(self):
        return self.train_data()

    def loss(self, output, target):
        return nn.functional.cross_entropy(output, target)
"""


def test_run_and_validate_reach_the_configuration_checks_only_through_launch_validation() -> None:
    launcher, cli = names_in(SRC / "launch" / "local.py"), names_in(SRC / "cli" / "main.py")
    assert {"validate_plan", "validate_task", "check_host"} <= launcher
    assert "validate_config" in cli  # `flotilla validate`: launch.validation.validate
    assert not (launcher | cli) & CONFIG_CHECKS, (launcher | cli) & CONFIG_CHECKS
    own = names_in(SRC / "launch" / "validation.py")
    assert {"check_job_task", "refusal", "pipeline_parts", "worker_device"} <= own


def _bad_configs(tmp_path: Path) -> dict[str, tuple[str, list[str]]]:
    (tmp_path / "not_sequential.py").write_text(textwrap.dedent(NOT_SEQUENTIAL))
    return {
        "plan": ("examples/partial_reduce.yaml", ["checkpoint.every_steps=5"]),
        "strategy settings": (
            "examples/ps_ssp.yaml",
            ["strategy.consistency={kind: wsp, s_local: 1, clock_distance: 1}"],
        ),
        "task import": ("examples/own_task/ps.yaml", [f"job.task={tmp_path / 'missing.py'}:Task"]),
        "task loss": ("examples/own_task/regression.yaml", ["job.task=./task.py:Spirals"]),
        "pipeline model": (
            "examples/own_task/pipeline.yaml",
            [f"job.task={tmp_path / 'not_sequential.py'}:Task", "job.task_args={}"],
        ),
        "pipeline memory": (  # (the split run cuts: a stage over its device's memory)
            "examples/pipeline_lm.yaml",
            ["cluster.workers=[{name: fast, memory_bytes: 2MiB}, {name: slow, memory_bytes: 2MiB}]"],
        ),
        "hetpipe placement": ("examples/hetpipe.yaml", ["strategy.placement=np"]),  # (node n2 cannot)
        # (found from outside: validate passed these, run refused them)
        "pipeline microbatches": ("examples/pipeline_lm.yaml", ["strategy.num_microbatches=1000"]),
        "batchnorm microbatches": (
            "examples/own_task/pipeline.yaml",
            ["job.task=./task.py:BNSpirals", "job.batch_size=8", "strategy.num_microbatches=8"],
        ),
    }


def _error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, output
    return lines[0]


CASES = [
    "plan",
    "strategy settings",
    "task import",
    "task loss",
    "pipeline model",
    "pipeline memory",
    "pipeline microbatches",
    "batchnorm microbatches",
]


@pytest.mark.parametrize("case", [*CASES, "hetpipe placement"])
def test_validate_refuses_what_run_refuses_with_the_same_line(tmp_path: Path, case: str) -> None:
    config, sets = _bad_configs(tmp_path)[case]
    args = [a for kv in sets for a in ("--set", kv)]
    shown = CliRunner().invoke(app, ["validate", str(ROOT / config), *args])
    assert shown.exit_code == 2, shown.output
    line = _error_line(shown.output)
    if case != "strategy settings":  # (that one is refused while loading, before validate())
        with pytest.raises(ConfigError) as err:
            validation.validate(load_config(ROOT / config, sets))
        assert line == f"error: {err.value}"
    if case in ("task import", "pipeline model", "hetpipe placement", "pipeline microbatches"):  # (~4 s each)
        run = subprocess.run(
            [sys.executable, "-m", "flotilla.cli.main", "run", config, *args, "--no-progress"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 2 and _error_line(run.stderr) == line, run.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the host check passes on a machine with CUDA")
def test_a_config_for_a_gpu_machine_validates_here_and_only_the_host_check_refuses_it() -> None:
    cfg = load_config(ROOT / "examples" / "own_task" / "allreduce.yaml", ["cluster.defaults.type=cuda"])
    assert validation.validate(cfg) == cfg.job.steps
    with pytest.raises(ConfigError, match="no usable CUDA device"):
        validation.check_host(cfg)
    assert validation.HOST_CHECKS and "CUDA" in validation.HOST_CHECKS[0]
