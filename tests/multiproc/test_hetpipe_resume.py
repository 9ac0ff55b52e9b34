"""HetPipe's checkpoints and ``--resume`` (``sync/hetpipe_host.py``): the parameter servers'
snapshots are the job's checkpoint (``<report>/ps-snapshots``, every 10 steps by default and at
the end); a job run again with more steps and ``--resume`` goes on from the clock the snapshots
reached, every virtual worker (VW) from the global weights, with the placement measured again;
a resume from a directory without snapshots is refused before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flotilla.config import load_config
from flotilla.core.errors import ConfigError
from flotilla.launch.pipeline import run_pipeline_job
from flotilla.launch.supervisor import Supervisor

from ._pipeline_job import hetpipe_nodes

pytestmark = pytest.mark.timeout(300)


def _cfg(tmp_path: Path, steps: int):
    path = tmp_path / f"hetpipe{steps}.yaml"
    path.write_text(hetpipe_nodes(steps))
    return load_config(path)


def _run(tmp_path: Path, name: str, steps: int, resume: Path | None = None) -> dict:
    out = tmp_path / name
    sup = Supervisor(out / "run")
    summary = run_pipeline_job(
        _cfg(tmp_path, steps), out / "report", out / "run", False, supervisor=sup, resume_dir=resume
    )
    assert all(c.proc.returncode == 0 for c in sup.children), [c.proc.returncode for c in sup.children]
    return summary


def test_a_finished_job_goes_on_from_its_servers_snapshots(tmp_path: Path) -> None:
    first = _run(tmp_path, "first", 40)
    snaps = tmp_path / "first" / "report" / "ps-snapshots"
    assert first["completed"] and sorted(p.name for p in snaps.iterdir()) == ["ps-shard-0-of-1.snap"]
    second = _run(tmp_path, "second", 80, resume=snaps)
    assert second["completed"] and second["steps"] == 80
    assert second["resumed"]["clock"] == 20 and second["resumed"]["step"] == 40  # (wave 2: s_local 1)
    hp = second["hetpipe"]
    assert hp["minibatches_checked"] == 3 * 40  # (np: a one-stage VW and a two-stage VW, 40 steps each)
    assert hp["max_staleness"] <= hp["s_global"]
    views = second["data_views"]["views"]
    assert views[0][0] == 20 and views[0][1] == [0, 1] and second["data_views"]["dropped"] == []
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "second" / "report" / "metrics.jsonl").read_text().splitlines()
        if line and json.loads(line).get("loss") is not None
    ]
    assert min(steps) == 41 and max(steps) == 80  # (the resumed job's records: steps 41 .. 80)
    assert len(second["train_losses"]) == 40  # (the lead VW's losses of those steps, none twice)
    # it went on from the trained weights: its first losses are those of the first job's end, far
    # below a fresh start's
    fresh, before, after = first["train_losses"][:4], first["train_losses"][-4:], second["train_losses"][:4]
    assert sum(after) < sum(fresh) * 0.9 and abs(sum(after) - sum(before)) < abs(sum(after) - sum(fresh))


def test_a_resume_from_a_directory_without_snapshots_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    empty = tmp_path / "nothing"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no parameter-server snapshot"):
        run_pipeline_job(_cfg(tmp_path, 40), tmp_path / "report", tmp_path / "run", False, resume_dir=empty)
    assert not (tmp_path / "report" / "summary.json").exists()
