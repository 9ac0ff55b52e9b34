"""``--resume auto`` (``launch.prepare.find_resume_dir``): the job's own checkpoint directory
under the report directory when it holds a checkpoint (allreduce: ``ckpt-*``; pipeline:
``stage<i>/ckpt-*``), else one ConfigError line naming where it looked."""

from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.config import load_config
from flotilla.core.errors import ConfigError
from flotilla.elastic.checkpoint import MANIFEST
from flotilla.launch.prepare import find_resume_dir

ROOT = Path(__file__).resolve().parents[2]


def _checkpoint(path: Path) -> None:
    """A complete-looking checkpoint directory (its contents are checked by the resume itself)."""
    path.mkdir(parents=True)
    (path / MANIFEST).write_text("{}")


def test_finds_the_default_and_the_configured_directory(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "examples/tiny.yaml", [])
    with pytest.raises(ConfigError, match=f"no checkpoint under {tmp_path / 'checkpoints'}"):
        find_resume_dir(cfg, tmp_path)
    _checkpoint(tmp_path / "checkpoints" / "ckpt-000000010")
    assert find_resume_dir(cfg, tmp_path) == tmp_path / "checkpoints"
    mine = load_config(ROOT / "examples/tiny.yaml", ["checkpoint.every_steps=5", "checkpoint.dir=ck"])
    with pytest.raises(ConfigError, match="no checkpoint under"):
        find_resume_dir(mine, tmp_path)
    _checkpoint(tmp_path / "ck" / "stage0" / "ckpt-000000020")  # a pipeline's layout
    assert find_resume_dir(mine, tmp_path) == tmp_path / "ck"


def test_needs_a_report_directory_for_a_relative_one() -> None:
    cfg = load_config(ROOT / "examples/tiny.yaml", [])
    with pytest.raises(ConfigError, match="--resume auto needs the run's --report directory"):
        find_resume_dir(cfg, None)
