"""Honest endings (issue 18 item 7), the pure and in-process parts:

- a pipeline restart is recorded with when (``at_s``) and why, and a run that restarted says so
  in ``degraded`` (``launch/pipeline_watch.Restarts``);
- the standalone coordinator's summary of an interrupted job is ``completed: false``,
  ``interrupted``, and still names the members it lost (``cli/role_cmds._finish``);
- the run directory that holds a pipeline's secret is 0700, the secret 0600
  (``launch/pipeline_attempt.write_run_secret``);
- a fresh run moves a previous run's default checkpoints aside to ``<dir>.prev``, keeping one
  previous set (``launch/prepare.set_aside_previous``).
"""

from __future__ import annotations

import json
import logging
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flotilla.cli.role_cmds import EXIT_MEMBERS_LOST, _finish
from flotilla.comm.auth import read_secret_file
from flotilla.elastic.checkpoint import list_checkpoints, write_checkpoint
from flotilla.launch.pipeline_attempt import write_run_secret
from flotilla.launch.pipeline_watch import Restarts, StageFailure
from flotilla.launch.prepare import set_aside_previous


def _failure(name: str, code: int, step: int) -> StageFailure:
    child = SimpleNamespace(name=name, returncode=code)
    return StageFailure(f"pipeline stage {name} exited with code {code}: boom", child, step)  # type: ignore[arg-type]


def test_a_restart_is_recorded_with_when_and_why_and_makes_the_run_degraded() -> None:
    restarts = Restarts(max_restarts=3, t0_unix=0.0)
    assert restarts.degraded_note() is None  # nothing happened: a plain success
    rec = restarts.add(_failure("slow", -9, 13), resumed_from_step=10)
    assert rec["stage"] == "slow" and rec["exit_code"] == -9 and rec["failed_at_step"] == 13
    assert rec["at_s"] == pytest.approx(rec["detected_at"], abs=1e-3) and rec["at_s"] > 0  # (t0 = 0)
    assert "exited with code -9" in rec["reason"]
    note = restarts.degraded_note()
    assert note is not None and "1 time(s)" in note and "slow (exit code -9 at step 13" in note


def test_a_failure_nobody_caused_restarts_free_while_the_job_progresses() -> None:
    """A group broken under every stage (the network, a frozen stage) restarts without taking from
    ``max_restarts``, up to ``FREE_RESTARTS``; the progress rule holds for it too."""
    from flotilla.launch.pipeline_watch import FREE_RESTARTS

    def broke(step: int) -> StageFailure:
        child = SimpleNamespace(name="slow", returncode=1)
        return StageFailure("group broke", child, step, nobody_failed=True)  # type: ignore[arg-type]

    off = Restarts(max_restarts=0, t0_unix=0.0)  # (0 turns restarts off, free ones too)
    assert not off.allowed(5) and not off.allowed(5, nobody_failed=True)
    restarts = Restarts(max_restarts=1, t0_unix=0.0)
    assert restarts.add(broke(5), resumed_from_step=0)["nobody_failed"] is True
    assert restarts.paid == 0 and not restarts.allowed(5, nobody_failed=True)  # (no progress since)
    assert restarts.allowed(6, nobody_failed=True) and restarts.allowed(6)  # (the budget is whole)
    for step in range(6, 5 + FREE_RESTARTS):
        restarts.add(broke(step), resumed_from_step=0)
    assert len(restarts.records) == FREE_RESTARTS and restarts.paid == 0
    assert restarts.allowed(99, nobody_failed=True)  # (past the free ones: the budget pays)
    assert restarts.add(broke(99), resumed_from_step=0)["nobody_failed"] is False and restarts.paid == 1
    assert not restarts.allowed(100, nobody_failed=True) and "max_restarts" in restarts.give_up_note(100)


def _snapshot(*, done: bool, lost: list[dict]) -> dict:
    row = {"name": "w0", "speed": 1.0, "state": "training", "step": 7, "samples": 70, "busy_s": 1.0}
    return {
        "final": {},
        "evals": [],
        "workers": [row, {**row, "name": "w1", "state": "dead"}],
        "members": [0],
        "epoch": 2,
        "done": done,
        "elapsed_s": 3.0,
        "members_lost": lost,
        "error": None,
    }


class _Coord:
    """The coordinator as ``_finish`` sees it (its metrics sink has opened ``metrics.jsonl``)."""

    def __init__(self, snap: dict, report: Path) -> None:
        self._snap = snap
        (report / "metrics.jsonl").touch()

    def settle_clocks(self) -> None:
        pass

    def snapshot(self) -> dict:
        return self._snap


def test_the_standalone_coordinators_summary_of_an_interrupted_job_is_incomplete(tmp_path: Path) -> None:
    lost = [{"worker_id": 1, "name": "w1", "at_s": 1.5, "why": "no heartbeat for 2 s"}]
    code = _finish(
        _Coord(_snapshot(done=False, lost=lost), tmp_path), "allreduce", tmp_path, interrupted=True
    )
    assert code == 130
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"] is False and summary["interrupted"] is True
    assert summary["error"] == "interrupted (Ctrl-C)"
    assert summary["members_lost"] == lost and "w1" in summary["degraded"]


def test_the_standalone_coordinators_summary_of_a_job_that_lost_members_is_degraded(tmp_path: Path) -> None:
    lost = [{"worker_id": 1, "name": "w1", "at_s": 1.5, "why": "its process ended (exit code 5)"}]
    code = _finish(
        _Coord(_snapshot(done=True, lost=lost), tmp_path), "allreduce", tmp_path, interrupted=False
    )
    assert code == EXIT_MEMBERS_LOST
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"] is True and "interrupted" not in summary
    assert summary["degraded"] == "lost 1 of 2 workers (w1): see members_lost"


def test_a_job_that_ended_unfinished_without_an_error_says_why(tmp_path: Path) -> None:
    """Every worker lost before the end, nobody stopped the job with an error: the summary's
    ``error`` names who was lost and why (``report/summary.unfinished_reason``)."""
    lost = [
        {"worker_id": 0, "name": "w0", "at_s": 1.0, "why": "its process ended (exit code -9)"},
        {"worker_id": 1, "name": "w1", "at_s": 1.5, "why": "no heartbeat for 10 s"},
    ]
    code = _finish(
        _Coord(_snapshot(done=False, lost=lost), tmp_path), "allreduce", tmp_path, interrupted=False
    )
    assert code == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"] is False
    assert summary["error"] == (
        "the job did not complete: it ended at step 7 with no worker left to train (2 of 2 workers "
        "lost or gone: w0: its process ended (exit code -9); w1: no heartbeat for 10 s)"
    )


def test_the_run_directory_holding_the_secret_is_private(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    path = write_run_secret(run_dir)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.parent == run_dir
    assert len(read_secret_file(path)) >= 16


def _checkpoint(directory: Path, step: int) -> None:
    parts = {"model": {"w": torch.full((2,), float(step))}}
    write_checkpoint(directory, step=step, parts=parts, meta={}, fingerprint="f", keep=3)


def test_a_fresh_run_moves_the_previous_checkpoints_aside_keeping_one_set(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "checkpoints"
    assert set_aside_previous(root) is None  # nothing there: nothing moved
    _checkpoint(root, 10)
    with caplog.at_level(logging.WARNING):
        aside = set_aside_previous(root)
    assert aside == tmp_path / "checkpoints.prev" and not root.exists()
    assert [p.name for p in list_checkpoints(aside)] == ["ckpt-000000010"]
    assert "moved aside" in caplog.text and str(aside) in caplog.text
    _checkpoint(root, 20)  # the next run's, then a third fresh run: only the newest previous set is kept
    assert set_aside_previous(root) == aside
    assert [p.name for p in list_checkpoints(aside)] == ["ckpt-000000020"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints.prev"]


def test_an_allreduce_runs_default_checkpoints_of_a_previous_run_are_moved_aside(tmp_path: Path) -> None:
    from flotilla.config import load_config
    from flotilla.launch.local import with_default_checkpoints
    from flotilla.launch.prepare import job_files

    cfg, added = with_default_checkpoints(load_config("examples/tiny.yaml"))
    assert added and cfg.checkpoint is not None and cfg.checkpoint.every_s == 10.0
    _checkpoint(tmp_path / "checkpoints", 10)
    files = job_files(cfg, output_dir=tmp_path, resume_dir=None, total_steps=30, default_checkpoints=True)
    assert files["checkpoint_dir"] == str((tmp_path / "checkpoints").resolve())
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints.prev")] == ["ckpt-000000010"]
    assert not list_checkpoints(tmp_path / "checkpoints")
