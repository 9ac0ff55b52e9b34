"""The launcher's refusals before anything starts: ``--resume`` for strategy ps, and a resume with
changed settings naming the settings that changed (not two fingerprints)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flotilla.cli.main import app
from flotilla.config import load_config
from flotilla.core.errors import ConfigError, FlotillaError
from flotilla.elastic.checkpoint import write_checkpoint
from flotilla.launch.local import Launcher
from flotilla.launch.prepare import config_changes, fingerprinted_config, job_files, refuse_changed_config

ROOT = Path(__file__).resolve().parents[2]
PS = ROOT / "examples/own_task/ps.yaml"
ALLREDUCE = ROOT / "examples/own_task/allreduce.yaml"


def test_resume_of_a_ps_job_without_snapshots_is_refused_in_one_line_before_anything_starts(
    tmp_path: Path,
) -> None:
    launcher = Launcher(load_config(PS), report_dir=None, run_dir=tmp_path / "run", resume_dir=tmp_path)
    with pytest.raises(ConfigError, match=f"^--resume {tmp_path}: no parameter-server snapshot"):
        launcher.run()
    assert not launcher.supervisor.children and list((tmp_path / "run").iterdir()) == []


def test_flotilla_run_resume_on_ps_without_snapshots_answers_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["run", str(PS), "--resume", str(tmp_path), "--run-dir", str(tmp_path / "r")]
    )
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: --resume {tmp_path}: no parameter-server snapshot"
    )


def test_fingerprinted_config_is_what_the_fingerprint_digests() -> None:
    for cfg in (
        load_config(ALLREDUCE),
        load_config(PS),
        load_config(ROOT / "examples/own_task/pipeline.yaml"),
    ):
        text = json.dumps(fingerprinted_config(cfg), sort_keys=True)
        assert hashlib.blake2b(text.encode(), digest_size=8).hexdigest() == cfg.fingerprint()


def test_config_changes_name_each_changed_setting() -> None:
    old = {"job": {"optimizer": {"kind": "adam", "lr": 0.003}, "seed": 0}, "strategy": {"kind": "allreduce"}}
    new = {
        "job": {"optimizer": {"kind": "adam", "lr": 0.01}, "seed": 0, "x": [1]},
        "strategy": {"kind": "allreduce"},
    }
    assert config_changes(old, new) == ["job.optimizer.lr: 0.003 -> 0.01", "job.x: unset -> [1]"]
    assert config_changes(old, old) == []


def _checkpoint_of(cfg, directory: Path, step: int = 100) -> None:  # type: ignore[no-untyped-def]
    write_checkpoint(
        directory,
        step=step,
        parts={"model": {"w": torch.zeros(1)}},
        meta={"config": fingerprinted_config(cfg)},
        fingerprint=cfg.fingerprint(),
    )


def test_a_resume_with_changed_settings_names_them(tmp_path: Path) -> None:
    _checkpoint_of(load_config(ALLREDUCE), tmp_path / "ck")
    changed = load_config(ALLREDUCE, ["job.optimizer.lr=0.01", "job.batch_size=32"])
    with pytest.raises(ConfigError) as info:
        job_files(changed, output_dir=tmp_path, resume_dir=tmp_path / "ck", total_steps=600)
    message = str(info.value)
    assert "\n" not in message and "fingerprint" not in message
    assert "job.batch_size: 64 -> 32; job.optimizer.lr: 0.003 -> 0.01" in message
    assert message.startswith(
        f"--resume {(tmp_path / 'ck').resolve()}: ckpt-000000100 was written with other"
    )


def test_the_same_settings_resume_and_a_checkpoint_without_settings_keeps_the_old_check(
    tmp_path: Path,
) -> None:
    cfg = load_config(ALLREDUCE)
    _checkpoint_of(cfg, tmp_path / "same")
    refuse_changed_config(
        tmp_path / "same", load_config(ALLREDUCE, ["job.steps=900"])
    )  # length: not a change
    files = job_files(cfg, output_dir=tmp_path, resume_dir=tmp_path / "same", total_steps=600)
    assert files["resume_dir"] == str((tmp_path / "same").resolve())
    write_checkpoint(tmp_path / "old", step=5, parts={"m": {"w": torch.zeros(1)}}, meta={}, fingerprint="x")
    refuse_changed_config(tmp_path / "old", cfg)  # no recorded settings: the loader's message follows
    with pytest.raises(FlotillaError, match="written by another configuration"):
        job_files(cfg, output_dir=tmp_path, resume_dir=tmp_path / "old", total_steps=600)


def test_flotilla_server_replica_refuses_a_bad_role_in_one_line(tmp_path: Path) -> None:
    """``flotilla server-replica`` (a replicated shard's process, also started by ``flotilla run``)."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 32)
    args = ["server-replica", str(PS), "--shard-index", "0", "--role", "leader", "--secret-file", str(secret)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "error: --role: primary (with --backup ADDRESS) or backup (without)" in result.output


@pytest.mark.parametrize(
    ("config", "sets", "expected"),
    [
        (PS, ["checkpoint={every_steps: 10}"], "error: checkpoint: strategy ps keeps its durable state"),
        (
            ROOT / "examples/partial_reduce.yaml",
            ["checkpoint={every_steps: 10}"],
            "error: checkpoint: strategy partial_reduce",
        ),
        (
            ROOT / "examples/adaptive.yaml",
            ["checkpoint={every_steps: 10}"],
            "error: checkpoint: strategy adaptive",
        ),
    ],
)
def test_validate_refuses_what_run_refuses_before_starting(
    config: Path, sets: list[str], expected: str
) -> None:
    result = CliRunner().invoke(app, ["validate", str(config), *(a for s in sets for a in ("--set", s))])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1].startswith(expected), result.output


def test_validate_accepts_checkpoints_for_adpsgd() -> None:
    """AD-PSGD checkpoints the average of its live replicas (``SyncStrategy.checkpoint_state``)."""
    sets = ["--set", "checkpoint={every_steps: 10}"]
    result = CliRunner().invoke(app, ["validate", str(ROOT / "examples/adpsgd.yaml"), *sets])
    assert result.exit_code == 0, result.output
