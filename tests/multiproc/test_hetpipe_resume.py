"""HetPipe's checkpoints and ``--resume`` (``sync/hetpipe_host.py``): the parameter servers'
snapshots are the job's checkpoint (``<report>/ps-snapshots``, every 10 steps by default and at
the end); a job run again with more steps and ``--resume`` goes on from the clock the snapshots
reached, every virtual worker (VW) from the global weights, with the placement measured again;
a resume from a directory without snapshots is refused before anything starts; a job SIGKILLed
whole mid-run goes on from its last snapshot with ``--resume auto`` (``-m slow``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flotilla.config import load_config
from flotilla.core.errors import ConfigError
from flotilla.launch.pipeline import run_pipeline_job
from flotilla.launch.supervisor import Supervisor

from ._jobs import records, start, stop, wait_for
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


@pytest.mark.slow  # (~40 s: the whole job SIGKILLed mid-run, then resumed by `--resume auto`)
def test_a_job_killed_whole_resumes_from_its_last_snapshot(tmp_path: Path) -> None:
    config = tmp_path / "hetpipe.yaml"
    config.write_text(hetpipe_nodes(200))
    report = tmp_path / "report"
    run = ["run", str(config), "--report", str(report), "--no-progress"]
    first = start(run, tmp_path / "first.log")  # (its own process group: the launcher and its stages)
    try:
        trained = lambda: sum(r.get("loss") is not None for r in records(report)) >= 150
        wait_for(lambda: trained() or first.poll() is not None, 200, "the first job trains")
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        stop(first)  # (SIGKILL to the whole group: nothing says goodbye)
    reached = max(int(r["step"]) for r in records(report) if r.get("loss") is not None)
    second = start([*run, "--resume", "auto"], tmp_path / "second.log")
    try:
        assert second.wait(timeout=240) == 0, (tmp_path / "second.log").read_text()[-3000:]
    finally:
        stop(second)
    summary = json.loads((report / "summary.json").read_text())
    # the last snapshot (every 10 steps, at a wave's start): at most a snapshot period and a wave
    # behind the last step recorded (records reach the report in batches: it may be ahead of them)
    step = summary["resumed"]["step"]
    assert summary["completed"] and reached - 12 <= step < 200 and step % 2 == 0, (reached, step)
    assert len(summary["train_losses"]) == 200 - step
    assert summary["hetpipe"]["max_staleness"] <= summary["hetpipe"]["s_global"]
    assert (report / "ps-snapshots.prev").is_dir()  # (the set resumed from, kept)
