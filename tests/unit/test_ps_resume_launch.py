"""``flotilla run --resume`` for strategy ps, the launcher's side (``launch/ps_resume.py``): the
previous job's snapshots (written here by real shard stores seeded with the job's model) are
checked and cut into this job's shards' snapshots before any process starts; every refusal is
one line naming the file or field and writes nothing; the snapshots resumed from are kept."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from flotilla.config import load_config
from flotilla.core.errors import ConfigError
from flotilla.launch import ps_resume
from flotilla.launch.prepare import find_resume_dir
from flotilla.ps.config import shard_config_from
from flotilla.ps.snapshot import capture, read_snapshot, snapshot_path, write_snapshot
from flotilla.ps.store import ShardStore
from flotilla.ps.wire import keys_of
from flotilla.trainer import builders

pytestmark = pytest.mark.timeout(60)

CONFIG = """
cluster: {{num_workers: 2}}
job:
  model: {{name: {model}}}
  dataset: {{name: synthetic, num_samples: 400}}
  optimizer: {{kind: sgd, lr: 0.05, momentum: 0.9}}
  batch_size: 40
  steps: 20
strategy: {{kind: ps, num_servers: {shards}, consistency: {{kind: bsp}}, update: server_sgd}}
"""


def config(tmp: Path, shards: int, model: str = "tiny_mlp"):
    path = tmp / f"job-{shards}-{model}.yaml"
    path.write_text(CONFIG.format(shards=shards, model=model))
    return load_config(path)


def previous_job(tmp: Path, shards: int = 2, clock: int = 4) -> Path:
    """Snapshots of a ``shards``-shard job of the tiny model whose 2 workers pushed ``clock`` clocks."""
    cfg = config(tmp, shards)
    params = {
        n: p.detach() for n, p in builders.build_task_model(cfg, builders.build_task(cfg)).named_parameters()
    }
    keys = keys_of(params)
    where = tmp / "old" / "ps-snapshots"
    where.mkdir(parents=True)
    ps = builders.ps_config_of(cfg, 20)  # (as roles/ps_server.py builds its shard's)
    template = shard_config_from(ps, num_workers=2, shard_index=0, data_key=cfg.data_fingerprint())
    for i in range(shards):
        store = ShardStore(replace(template, shard_index=i))
        layout = store.make_layout(keys)
        chunks = [layout.plan.chunks[c] for c in layout.chunk_ids]
        values = [params[c.key].reshape(-1)[c.offset_elems : c.offset_elems + c.num_elems] for c in chunks]
        store.seed(list(keys), list(layout.chunk_ids), values)
        for w in range(2):
            store.hello(w, 0, resync=False)
        for c in range(clock):
            for w in range(2):
                store.push(w, c, 0, list(layout.chunk_ids), [v * 0.01 for v in values])
        write_snapshot(snapshot_path(where, i, shards), capture(store, incarnation=i + 1))
    return tmp / "old"


def test_the_snapshots_are_cut_into_this_jobs_shards_and_the_old_ones_are_kept(tmp_path: Path) -> None:
    old = previous_job(tmp_path)
    before = {p.name: p.read_bytes() for p in (old / "ps-snapshots").iterdir()}
    out = tmp_path / "new" / "ps-snapshots"
    got = ps_resume.prepare(config(tmp_path, 3), old, out, total_steps=20)
    assert got.num_shards == 2 and got.resume_at == 4 and got.behind == (0, 0)
    assert got.source == old / "ps-snapshots"
    assert sorted(p.name for p in out.iterdir()) == [f"ps-shard-{i}-of-3.snap" for i in range(3)]
    assert all(read_snapshot(p).meta["resume_at"] == 4 for p in out.iterdir())
    assert {p.name: p.read_bytes() for p in (old / "ps-snapshots").iterdir()} == before  # untouched


def test_resuming_from_the_jobs_own_directory_moves_the_old_snapshots_aside(tmp_path: Path) -> None:
    old = previous_job(tmp_path)
    own = old / "ps-snapshots"
    assert find_resume_dir(config(tmp_path, 3), old) == own  # (--resume auto)
    got = ps_resume.prepare(config(tmp_path, 3), old, own, total_steps=20)
    aside = old / "ps-snapshots.prev"
    assert got.source == aside and sorted(p.name for p in aside.iterdir()) == [
        "ps-shard-0-of-2.snap",
        "ps-shard-1-of-2.snap",
    ]
    assert sorted(p.name for p in own.iterdir()) == [f"ps-shard-{i}-of-3.snap" for i in range(3)]


def refused(tmp: Path, cfg, source: Path, total_steps: int = 20) -> str:
    out = tmp / "new" / "ps-snapshots"
    with pytest.raises(ConfigError) as info:
        ps_resume.prepare(cfg, source, out, total_steps=total_steps)
    assert not out.exists()  # nothing written
    message = str(info.value)
    assert "\n" not in message
    return message


def test_what_cannot_be_resumed_is_refused_in_one_line_writing_nothing(tmp_path: Path) -> None:
    old = previous_job(tmp_path)
    assert "no parameter-server snapshot" in refused(tmp_path, config(tmp_path, 3), tmp_path / "nothing")
    message = refused(tmp_path, config(tmp_path, 3), old, total_steps=4)
    assert "its shards stand at clock 4" in message and "nothing left to train" in message
    other_model = refused(tmp_path, config(tmp_path, 3, model="mlp"), old)  # (a zoo model: its task args)
    assert "written by a job with other data" in other_model, other_model
    (old / "ps-snapshots" / "ps-shard-1-of-2.snap").unlink()
    message = refused(tmp_path, config(tmp_path, 3), old)
    assert "the snapshot of shard 1 is missing" in message and "ps-shard-1-of-2.snap" in message


def test_another_jobs_snapshots_in_the_target_are_moved_aside_never_deleted(tmp_path: Path) -> None:
    old = previous_job(tmp_path)
    target = tmp_path / "new" / "ps-snapshots"
    target.mkdir(parents=True)
    (target / "ps-shard-0-of-1.snap").write_bytes(b"another job's")
    ps_resume.prepare(config(tmp_path, 3), old, target, total_steps=20)
    assert (tmp_path / "new" / "ps-snapshots.prev" / "ps-shard-0-of-1.snap").read_bytes() == b"another job's"
    assert sorted(p.name for p in target.iterdir()) == [f"ps-shard-{i}-of-3.snap" for i in range(3)]
    # resuming from that .prev while another set sits in the target would overwrite the source
    (tmp_path / "new" / "ps-snapshots.prev").rename(tmp_path / "kept")
    (tmp_path / "new" / "ps-snapshots").rename(tmp_path / "new" / "ps-snapshots.prev")
    target.mkdir()
    (target / "ps-shard-0-of-1.snap").write_bytes(b"another job's")
    with pytest.raises(ConfigError, match="holds another job's snapshots"):
        ps_resume.prepare(config(tmp_path, 3), tmp_path / "new" / "ps-snapshots.prev", target, total_steps=20)
    assert (target / "ps-shard-0-of-1.snap").read_bytes() == b"another job's"  # untouched


def test_a_job_with_another_seed_is_refused(tmp_path: Path) -> None:
    old = previous_job(tmp_path)
    cfg = config(tmp_path, 3)
    other = cfg.model_copy(update={"job": cfg.job.model_copy(update={"seed": 7})})
    assert "written by a job with other data" in refused(tmp_path, other, old)


def test_under_delta_updates_the_workers_optimizers_restarting_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = previous_job(tmp_path)
    cfg = config(tmp_path, 2)
    delta = cfg.model_copy(update={"strategy": cfg.strategy.model_copy(update={"update": "delta"})})
    with caplog.at_level("WARNING", logger="flotilla.launcher"):
        ps_resume.prepare(delta, old, tmp_path / "new" / "ps-snapshots", total_steps=20)
    assert any("own optimizer (sgd) restarts without its state" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="flotilla.launcher"):
        ps_resume.prepare(cfg, old, tmp_path / "again" / "ps-snapshots", total_steps=20)
    assert not any("restarts without its state" in r.getMessage() for r in caplog.records)
