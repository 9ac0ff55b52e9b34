"""A pipeline stage SIGKILLed mid-run: the job restarts every stage from the newest step all of
them checkpointed (checkpoints are on by default) and ends with the uninterrupted run's final
weights and losses, bit for bit; the summary counts the restart and the kill -> first step after
the restart is printed.  The fault is handed in by the test: it kills the stage's process itself."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flotilla.core.errors import ConfigError, FlotillaError
from flotilla.elastic.checkpoint import list_checkpoints
from flotilla.launch.pipeline import run_pipeline_job
from flotilla.launch.supervisor import Supervisor

from ._pipeline_job import kill_stage_at, pipeline_cfg, run_killing

BASE = ("job.steps=30", "job.eval_every_steps=0")  # on the shared job (tests/multiproc/_pipeline_job.py)


def _cfg(tmp_path: Path, *overrides: str):
    return pipeline_cfg(tmp_path, *BASE, *overrides)


@pytest.mark.timeout(300)
def test_a_sigkilled_stage_restarts_from_the_newest_checkpoint_with_the_same_result(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    plain = run_pipeline_job(cfg, tmp_path / "plain", tmp_path / "plain-run", False)
    assert plain["restarts"] == [] and plain["completed"] and plain["degraded"] is None
    assert (tmp_path / "plain" / "checkpoints" / "stage0").is_dir()  # on by default

    sup = Supervisor(tmp_path / "run")
    killed: dict = {}
    killer = threading.Thread(
        target=kill_stage_at, args=(sup, tmp_path / "run", "slow", 13, killed), daemon=True
    )
    killer.start()
    summary = run_pipeline_job(cfg, tmp_path / "report", tmp_path / "run", False, supervisor=sup)
    killer.join()
    assert killed, "the stage was never killed"
    assert summary["completed"] and len(summary["restarts"]) == 1
    restart = summary["restarts"][0]
    assert restart["stage"] == "slow" and restart["exit_code"] == -signal.SIGKILL
    # the newest step both stages checkpointed (every 10 steps by default) before the kill
    assert restart["resumed_from_step"] in (10, 20) and restart["failed_at_step"] >= 13
    assert restart["resumed_from_step"] <= killed["step"] <= restart["failed_at_step"]
    # when (seconds since the job started) and why; a run that restarted is not a bare success
    assert 0 < restart["at_s"] < summary["job_wall_s"] and "slow exited with code -9" in restart["reason"]
    assert "restarted every stage 1 time(s) after slow (exit code -9" in summary["degraded"]
    assert summary["train_losses"] == plain["train_losses"] and len(plain["train_losses"]) == 30
    assert summary["test_loss"] == plain["test_loss"]
    got, want = load_file(summary["model_file"]), load_file(plain["model_file"])
    assert set(got) == set(want) and all(bool((got[k] == want[k]).all()) for k in want)
    on_disk = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert len(on_disk["restarts"]) == 1 and on_disk["degraded"] == summary["degraded"]
    print(
        f"\nkill -> first step after restart: {restart['first_step_at'] - killed['at']:.2f} s "
        f"(detected {restart['detected_at'] - killed['at']:.2f} s after the kill)"
    )
    assert all(c.proc.returncode is not None for c in sup.children)


@pytest.mark.timeout(300)
def test_a_frozen_stage_is_found_silent_killed_and_the_job_restarted(tmp_path: Path) -> None:
    """A SIGSTOPped stage never fails: its neighbour would wait in a collective until
    ``step_timeout_s``; the launcher finds it silent for ``cluster.heartbeat_timeout_s`` (its host
    hears no beat), kills it and restarts the job, naming why."""
    cfg = _cfg(tmp_path, "cluster.heartbeat_timeout_s=2", "strategy.step_timeout_s=120")
    sup = Supervisor(tmp_path / "run")
    frozen: dict = {}
    freezer = threading.Thread(
        target=kill_stage_at, args=(sup, tmp_path / "run", "slow", 13, frozen, signal.SIGSTOP), daemon=True
    )
    freezer.start()
    summary = run_pipeline_job(cfg, tmp_path / "report", tmp_path / "run", False, supervisor=sup)
    freezer.join()
    assert frozen, "the stage was never frozen"
    assert summary["completed"] and len(summary["restarts"]) == 1 and len(summary["train_losses"]) == 30
    restart = summary["restarts"][0]
    assert restart["stage"] == "slow" and restart["exit_code"] == -signal.SIGKILL
    assert "silent for more than 2 s (cluster.heartbeat_timeout_s: frozen or hung)" in restart["reason"]
    found = restart["detected_at"] - frozen["at"]
    print(f"\nfrozen stage: found silent and the job restarting {found:.2f} s after SIGSTOP (timeout 2 s)")
    assert found < 60  # (far below the 120-s step timeout it would otherwise have waited for)


@pytest.mark.slow  # (40-75 s on 2 loaded cores; the restart path itself is in the test above)
@pytest.mark.timeout(300)
def test_a_stage_that_fails_again_without_progress_ends_the_run_after_one_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deterministic fault (the stage crashes at the same step every time) is restarted once,
    then the run fails with the stage's line and why it gave up, still writes its summary
    (``completed: false``), and leaves nothing running."""
    monkeypatch.setenv("FLOTILLA_FAULT_CRASH", "slow@2")
    sup = Supervisor(tmp_path / "run")
    with pytest.raises(
        FlotillaError, match=r"slow exited with code 17.*gave up after 1 restart\(s\): no progress"
    ):
        run_pipeline_job(
            _cfg(tmp_path, "job.steps=12", "strategy.step_timeout_s=5"),
            tmp_path / "report",
            tmp_path / "run",
            False,
            supervisor=sup,
        )
    assert len(sup.children) == 4  # two attempts of two stages
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())  # written all the same
    assert summary["completed"] is False and "gave up after 1 restart" in summary["error"]
    assert [r["stage"] for r in summary["restarts"]] == ["slow"]
    assert all(c.proc.returncode is not None for c in sup.children)


def test_max_restarts_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_restarts"):
        _cfg(tmp_path, "job.max_restarts=-1")
    assert _cfg(tmp_path, "job.max_restarts=0").job.max_restarts == 0


@pytest.mark.timeout(300)
def test_a_sigkilled_pipedream_stage_restarts_from_the_checkpoint_its_stages_wrote_after_their_updates(
    tmp_path: Path,
) -> None:
    """PipeDream never flushes: each stage checkpoints right after its own update of every tenth
    minibatch (``trainer/pipeline_checkpoint.py``).  A stage SIGKILLed at step 13: the job
    restarts from step 10 -- every stage's weights and optimizer after its 10th update, the
    losses so far -- through a refilled pipeline, and completes.  Not the uninterrupted run's
    bits (the minibatches in flight ran again with newer weights), but its first 10 losses and
    a loss after the restart as far from the start as the uninterrupted run's."""
    cfg = _cfg(tmp_path, "strategy.schedule=pipedream")
    plain = run_pipeline_job(cfg, tmp_path / "plain", tmp_path / "plain-run", False)
    assert plain["completed"] and (tmp_path / "plain" / "checkpoints" / "stage1").is_dir()
    # (killed at step 13 once step 10's checkpoint is on both stages' disks: written in the
    # background, it may still be a temporary at step 13 on a loaded machine -- then the job rightly
    # went back to step 0, and this test had nothing restored to check)
    ck = tmp_path / "report" / "checkpoints"
    written = lambda: all(  # (step 10's, or a newer one if the job is past it)
        any(c.name >= "ckpt-000000010" for c in list_checkpoints(ck / f"stage{i}")) for i in (0, 1)
    )
    summary, killed = run_killing(cfg, tmp_path, "slow", 13, ready=written)
    assert summary["completed"] and len(summary["restarts"]) == 1
    restart = summary["restarts"][0]
    assert restart["stage"] == "slow" and restart["resumed_from_step"] in (10, 20)
    assert restart["nobody_failed"] is False  # (a kill: it took one of job.max_restarts)
    got, want = summary["train_losses"], plain["train_losses"]
    at = restart["resumed_from_step"]
    assert len(got) == len(want) == 30 and got[:at] == want[:at]
    # (the weights were restored, not made afresh: the loss right after the restart is as far
    # below the first one as the uninterrupted run's)
    assert abs(got[at] - want[at]) < 0.25 * (want[0] - want[at]), (got[at], want[at], want[0])
    print(f"\npipedream: killed at step {killed['step']}, from {at}: loss {got[at]:.3f} vs {want[at]:.3f}")
