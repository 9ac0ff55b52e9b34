"""A job's set of shard snapshots on disk, as a resumed job finds, keeps and cuts them (the rules
of the cut: ``ps/reshard.py``).  Used by ``flotilla run --resume`` for strategy ps
(``launch/ps_resume.py``) and for hetpipe's servers (``sync/hetpipe_host.py``).

Guarantees
- A set is found in a snapshot directory (``ps-shard-<i>-of-<N>.snap`` files) or in the
  ``ps-snapshots/`` of a report directory (:func:`find_snapshots`).
- :func:`cut` reads and checks every snapshot (every shard, the same model, the same chunks:
  ``ps/reshard.merge``, ``check_keys``) and cuts the state **before** touching any file: a
  refusal is one line and changes nothing.  No snapshot is deleted: the set already in the
  target directory is moved aside to ``<dir>.prev`` first (:func:`set_aside`, replacing an older
  set there); reading from that ``.prev`` while another set sits in the target is refused
  (moving it aside would overwrite the source).  The new snapshots are written atomically
  (``ps/snapshot.write_snapshot``).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flotilla.core.errors import ConfigError
from flotilla.core.log import get_logger
from flotilla.ps.config import ShardConfig
from flotilla.ps.sharding import KeySpec

__all__ = ["PATTERN", "SUBDIR", "Cut", "cut", "find_snapshots", "say_behind", "set_aside"]

log = get_logger("ps.snapshots")

PATTERN = "ps-shard-*-of-*.snap"
SUBDIR = "ps-snapshots"


@dataclass(frozen=True, slots=True)
class Cut:
    """What :func:`cut` wrote: the previous job's state (``ps/reshard.Resumed``: its shard count,
    the clock the job goes on from, what each shard lacked) and where its snapshots are now."""

    source: Path
    num_shards: int
    resume_at: int
    behind: tuple[int, ...]
    reach: tuple[int, ...]


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


def cut(
    source: Path,
    template: ShardConfig,
    keys: Sequence[KeySpec],
    snapshot_dir: Path,
    label: str,
    *,
    wave_size: int,
    total_steps: int,
) -> Cut:
    """The snapshots in ``source`` merged and cut into ``template``'s job (``template.num_shards``
    shards of its chunk size) and written to ``snapshot_dir``, where that job's shards resume
    from (module doc).  ``label`` names the resume in errors (e.g. ``--resume DIR``); a state
    whose clock (x ``wave_size``) leaves none of ``total_steps`` to train is refused."""
    from flotilla.ps.reshard import check_keys, merge, reshard
    from flotilla.ps.snapshot import read_snapshot, snapshot_path, write_snapshot

    snaps = [read_snapshot(f) for f in sorted(source.glob(PATTERN))]  # (SnapshotError names the file)
    resumed = merge(snaps, template)
    check_keys(resumed, list(keys), str(source))
    if resumed.resume_at * wave_size >= total_steps:
        raise ConfigError(
            f"{label}: its shards stand at clock {resumed.resume_at} (step "
            f"{resumed.resume_at * wave_size}), the job has {total_steps} steps: nothing left to train"
        )
    new = reshard(resumed, template, list(keys))
    snapshot_dir = Path(snapshot_dir)
    aside = snapshot_dir.with_name(snapshot_dir.name + ".prev")
    if any(snapshot_dir.glob(PATTERN)) and source.resolve() != snapshot_dir.resolve():
        if aside.exists() and source.resolve() == aside.resolve():
            raise ConfigError(
                f"{label}: {snapshot_dir} holds another job's snapshots, which would "
                f"be moved to {aside}, where this resume reads from: move them away first"
            )
    if set_aside(snapshot_dir) is not None and source.resolve() == snapshot_dir.resolve():
        source = aside  # (the resumed set, or another job's: kept, never deleted)
    for j, snap in enumerate(new):
        write_snapshot(snapshot_path(snapshot_dir, j, len(new)), snap)
    return Cut(
        source=source,
        num_shards=resumed.num_shards,
        resume_at=resumed.resume_at,
        behind=resumed.behind,
        reach=resumed.reach,
    )


def say_behind(done: Cut) -> None:
    """A warning for each previous shard that stood behind the clock the job goes on from."""
    for i, lacked in enumerate(done.behind):
        if lacked:
            log.warning(
                "previous shard %d stood at clock %d, the job goes on from clock %d: %d worker-clock(s) "
                "of pushes are not in its chunks (lost since its last snapshot, or never computed)",
                i,
                done.reach[i],
                done.resume_at,
                lacked,
            )
