"""``flotilla run --resume DIR`` for strategy ps: the previous job's shard snapshots, merged and
cut into this job's shards (``ps/reshard.py``; the files: ``ps/snapshot_sets.py``), written where
this job's shards resume from.

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

from dataclasses import dataclass
from pathlib import Path

from flotilla.config import RunConfig
from flotilla.core.errors import ConfigError
from flotilla.core.log import get_logger
from flotilla.ps.snapshot_sets import PATTERN, SUBDIR, cut, find_snapshots, say_behind, set_aside

__all__ = ["PSResume", "find_snapshots", "prepare", "require_snapshots", "set_aside"]

log = get_logger("launcher")


@dataclass(frozen=True, slots=True)
class PSResume:
    source: Path  # where the previous snapshots were read (after a move aside: where they are)
    num_shards: int  # the previous job's
    resume_at: int  # the clock (x wave size: the step) the job goes on from
    behind: tuple[int, ...]  # per previous shard: worker-clocks it lacked


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
    from flotilla.ps.wire import keys_of
    from flotilla.trainer import builders

    source = require_snapshots(resume_dir)
    ps = builders.ps_config_of(cfg, total_steps)
    workers = cfg.cluster.effective_num_workers()
    template = shard_config_from(ps, num_workers=workers, shard_index=0, data_key=cfg.data_fingerprint())
    model = builders.build_task_model(cfg, builders.build_task(cfg))
    keys = keys_of({n: p for n, p in model.named_parameters() if p.requires_grad})
    label = f"--resume {resume_dir}"
    done = cut(
        source, template, keys, Path(snapshot_dir), label, wave_size=ps.wave_size, total_steps=total_steps
    )
    log.warning(
        "resuming the parameter server from %s: %d shard(s) cut into %d, from clock %d (step %d)",
        done.source,
        done.num_shards,
        template.num_shards,
        done.resume_at,
        done.resume_at * ps.wave_size,
    )
    if isinstance(ps.update, DeltaUpdate):  # (the workers' optimizers are not in the shards)
        log.warning(
            "update: delta -- each worker's own optimizer (%s) restarts without its state, as a "
            "mid-run joiner's does: the shards hold the weights only",
            cfg.job.optimizer.kind,
        )
    say_behind(done)
    return PSResume(
        source=done.source, num_shards=done.num_shards, resume_at=done.resume_at, behind=done.behind
    )
