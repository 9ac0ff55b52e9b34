"""Checkpoints: atomic layout, verification on read, pruning, the exported model."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flotilla.elastic.checkpoint import (
    CheckpointError,
    export_model,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    write_checkpoint,
)


def _parts(step: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(3, 4, generator=g), "b": torch.arange(4.0) + step},
        "optim": {"t0": torch.full((2,), float(step))},
    }


def test_round_trip_is_bitwise(tmp_path: Path) -> None:
    parts = _parts(7)
    write_checkpoint(tmp_path, step=7, parts=parts, meta={"sampler": 7}, fingerprint="f1")
    ckpt = latest_checkpoint(tmp_path, fingerprint="f1")
    assert ckpt.step == 7 and ckpt.meta == {"sampler": 7}
    for part, tensors in parts.items():
        for key, value in tensors.items():
            assert torch.equal(ckpt.parts[part][key], value)


def test_keep_prunes_the_oldest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        write_checkpoint(tmp_path, step=step, parts=_parts(step), meta={}, fingerprint="f", keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000000003", "ckpt-000000004"]
    assert latest_checkpoint(tmp_path, fingerprint="f").step == 4


def test_another_config_is_refused(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, step=1, parts=_parts(1), meta={}, fingerprint="mine")
    with pytest.raises(CheckpointError, match="another configuration"):
        latest_checkpoint(tmp_path, fingerprint="theirs")


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, step=5, parts=_parts(5), meta={}, fingerprint="f")
    target = path / "model.safetensors"
    target.write_bytes(target.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="model.safetensors is truncated or corrupt"):
        load_checkpoint(path, fingerprint="f")


def test_unfinished_write_is_invisible(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, step=1, parts=_parts(1), meta={}, fingerprint="f")
    # a writer killed before its rename leaves only a temporary directory without effect
    (tmp_path / f".ckpt-000000002.{os.getpid()}.tmp").mkdir()
    assert latest_checkpoint(tmp_path, fingerprint="f").step == 1


def test_empty_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint under"):
        latest_checkpoint(tmp_path / "none", fingerprint=None)


def test_exported_model_loads_into_the_model(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    path = export_model(tmp_path / "model.safetensors", model.state_dict())
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    fresh.load_state_dict(load_file(path))
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)


def _dead_pid() -> int:
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


def test_a_killed_writers_leftovers_are_cleaned_and_a_step_can_be_rewritten(tmp_path: Path) -> None:
    (tmp_path / f".ckpt-000000009.{_dead_pid()}.tmp").mkdir(parents=True)
    write_checkpoint(tmp_path, step=3, parts=_parts(3), meta={"n": 1}, fingerprint="f")
    assert not list(tmp_path.glob(".ckpt-*.tmp"))
    write_checkpoint(tmp_path, step=3, parts=_parts(4), meta={"n": 2}, fingerprint="f")
    ckpt = latest_checkpoint(tmp_path, fingerprint="f")
    assert ckpt.meta == {"n": 2} and torch.equal(ckpt.parts["optim"]["t0"], torch.full((2,), 4.0))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000000003"]


def test_a_live_writers_temporary_directory_is_left_alone(tmp_path: Path) -> None:
    """A former rank 0 may still be writing in the background while the new one writes."""
    with subprocess.Popen(["sleep", "30"]) as writer:
        try:
            busy = tmp_path / f".ckpt-000000008.{writer.pid}.tmp"
            busy.mkdir(parents=True)
            write_checkpoint(tmp_path, step=9, parts=_parts(9), meta={}, fingerprint="f")
            assert busy.is_dir()
            assert latest_checkpoint(tmp_path, fingerprint="f").step == 9
        finally:
            writer.kill()
