"""``flotilla run --resume DIR`` for strategy ps: the previous job's shard snapshots, merged and
cut into this job's shards (``ps/reshard.py``), written where this job's shards resume from.

Guarantees
- ``DIR`` is a snapshot directory (``ps-shard-<i>-of-<N>.snap`` files) or a report directory
  holding one (``ps-snapshots/``); ``--resume auto`` finds the latter under the job's report
  directory.  Everything is read, checked (every shard present, the same model, the same
  ``chunk_bytes``, the same data order and steps per clock, clocks left to train) and cut
  **before** any file is touched: a refusal is one line naming the file or field and changes
  nothing.
- No snapshot is deleted: the set in this job's own snapshot directory -- the one resumed from
  (``--resume auto``), or another job's -- is moved aside to ``ps-snapshots.prev`` first
  (replacing an older set there); resuming from ``ps-snapshots.prev`` while another set sits in
  ``ps-snapshots`` is refused (moving it aside would overwrite the source).  The new snapshots
  are written atomically (``ps/snapshot.write_snapshot``) before any shard starts; each shard
  restores its own.
- The resume is said in one line (the previous shard count, the clock the job goes on from);
  a shard that stood behind the others (``Resumed.behind``), and under ``update: delta`` the
  workers' own optimizers restarting without their state, in a warning each.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from flotilla.config import RunConfig
from flotilla.core.errors import ConfigError
from flotilla.core.log import get_logger

__all__ = ["PSResume", "find_snapshots", "prepare", "require_snapshots", "set_aside"]

log = get_logger("launcher")

PATTERN = "ps-shard-*-of-*.snap"
SUBDIR = "ps-snapshots"


@dataclass(frozen=True, slots=True)
class PSResume:
    source: Path  # where the previous snapshots were read (after a move aside: where they are)
    num_shards: int  # the previous job's
    resume_at: int  # the clock (x wave size: the step) the job goes on from
    behind: tuple[int, ...]  # per previous shard: worker-clocks it lacked


def find_snapshots(directory: Path) -> Path | None:
    """The snapshot directory ``directory`` is or holds (``ps-snapshots/``); None if neither."""
    for d in (directory, directory / SUBDIR):
        if d.is_dir() and any(d.glob(PATTERN)):
            return d
    return None


def set_aside(snapshot_dir: Path) -> Path | None:
    """Move the snapshots in ``snapshot_dir`` aside to ``<dir>.prev`` (replacing an older set
    there) and leave ``snapshot_dir`` empty; where they went, or None if it held none."""
    if not any(snapshot_dir.glob(PATTERN)):
        snapshot_dir.mkdir(parents=True, exist_ok=True)
        return None
    aside = snapshot_dir.with_name(snapshot_dir.name + ".prev")
    if aside.exists():
        shutil.rmtree(aside)
    snapshot_dir.rename(aside)
    snapshot_dir.mkdir(parents=True)
    log.warning("parameter-server snapshots found in %s are kept in %s", snapshot_dir, aside)
    return aside


def require_snapshots(resume_dir: Path) -> Path:
    """The snapshot directory under ``resume_dir`` (a cheap check made before any process
    starts); ``ConfigError`` if there is none."""
    source = find_snapshots(Path(resume_dir))
    if source is None:
        raise ConfigError(
            f"--resume {resume_dir}: no parameter-server snapshot ({PATTERN}) in it or in its "
            f"{SUBDIR}/: strategy ps resumes from its shards' snapshots"
        )
    return source


def prepare(cfg: RunConfig, resume_dir: Path, snapshot_dir: Path, total_steps: int) -> PSResume:
    """Cut the snapshots under ``resume_dir`` into this job's shards' snapshots in
    ``snapshot_dir`` (module doc); ``ConfigError`` (nothing changed) if they cannot be."""
    from flotilla.ps.config import DeltaUpdate, shard_config_from
    from flotilla.ps.reshard import check_keys, merge, reshard
    from flotilla.ps.snapshot import read_snapshot, snapshot_path, write_snapshot
    from flotilla.ps.wire import keys_of
    from flotilla.trainer import builders

    source = require_snapshots(resume_dir)
    snaps = [read_snapshot(f) for f in sorted(source.glob(PATTERN))]  # (SnapshotError names the file)
    ps = builders.ps_config_of(cfg, total_steps)
    workers = cfg.cluster.effective_num_workers()
    template = shard_config_from(ps, num_workers=workers, shard_index=0, data_key=cfg.data_fingerprint())
    resumed = merge(snaps, template)
    model = builders.build_task_model(cfg, builders.build_task(cfg))
    keys = keys_of({n: p for n, p in model.named_parameters() if p.requires_grad})
    check_keys(resumed, keys, str(source))
    if resumed.resume_at * ps.wave_size >= total_steps:
        raise ConfigError(
            f"--resume {resume_dir}: its shards stand at clock {resumed.resume_at} (step "
            f"{resumed.resume_at * ps.wave_size}), the job has {total_steps} steps: nothing left to train"
        )
    new = reshard(resumed, template, keys)
    snapshot_dir = Path(snapshot_dir)
    aside = snapshot_dir.with_name(snapshot_dir.name + ".prev")
    if any(snapshot_dir.glob(PATTERN)) and source.resolve() != snapshot_dir.resolve():
        if aside.exists() and source.resolve() == aside.resolve():
            raise ConfigError(
                f"--resume {resume_dir}: {snapshot_dir} holds another job's snapshots, which would "
                f"be moved to {aside}, where this resume reads from: move them away first"
            )
    if set_aside(snapshot_dir) is not None and source.resolve() == snapshot_dir.resolve():
        source = aside  # (the resumed set, or another job's: kept, never deleted)
    for j, snap in enumerate(new):
        write_snapshot(snapshot_path(snapshot_dir, j, len(new)), snap)
    log.warning(
        "resuming the parameter server from %s: %d shard(s) cut into %d, from clock %d (step %d)",
        source,
        resumed.num_shards,
        len(new),
        resumed.resume_at,
        resumed.resume_at * ps.wave_size,
    )
    if isinstance(ps.update, DeltaUpdate):  # (the workers' optimizers are not in the shards)
        log.warning(
            "update: delta -- each worker's own optimizer (%s) restarts without its state, as a "
            "mid-run joiner's does: the shards hold the weights only",
            cfg.job.optimizer.kind,
        )
    for i, lacked in enumerate(resumed.behind):
        if lacked:
            log.warning(
                "previous shard %d stood at clock %d, the job goes on from clock %d: %d worker-clock(s) "
                "of pushes are not in its chunks (lost since its last snapshot, or never computed)",
                i,
                resumed.reach[i],
                resumed.resume_at,
                lacked,
            )
    return PSResume(
        source=source, num_shards=resumed.num_shards, resume_at=resumed.resume_at, behind=resumed.behind
    )
