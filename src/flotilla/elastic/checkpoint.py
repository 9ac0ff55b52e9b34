"""Durable checkpoints and the exported model, in safetensors plus a small JSON manifest (no pickle).

Layout of a checkpoint directory ``DIR``::

    DIR/ckpt-000000120/          one checkpoint: the committed state after 120 steps
        <part>.safetensors       named tensor files (e.g. model, optim, stage0, shard1)
        manifest.json            written last: step, config fingerprint, meta, per-file size+digest,
                                 and optionally the LR scheduler's state (``scheduler``, JSON)
    DIR/.ckpt-000000120.<pid>.tmp   a checkpoint being written (ignored by readers; a killed
                                    writer's is removed by the next write)

Guarantees
- **Atomic**: files are written and fsynced inside a temporary directory, the manifest last, then
  the directory is renamed into place and its parent fsynced.  A killed writer leaves either no
  ``ckpt-*`` directory for that step or a complete one; never a half-written checkpoint.
- **Checked on read**: :func:`load_checkpoint` verifies the manifest, the config fingerprint and
  every file's size and BLAKE2b digest; a mismatch is one :class:`CheckpointError` line naming the
  checkpoint and the file, and nothing is loaded.
- ``keep`` newest complete checkpoints are retained; older ones are removed after a new one landed.
- **Scheduler state** (optional): a learning-rate scheduler's ``state_dict`` is plain numbers,
  strings, lists and mappings; it is stored as JSON in the manifest (never pickle;
  :func:`plain_state` checks it and names the first value that is not plain).  Checkpoints
  without it (older ones, or jobs without a schedule) load with ``scheduler=None``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from flotilla.core.atomic_io import atomic_write_bytes
from flotilla.core.errors import FlotillaError

MANIFEST = "manifest.json"
FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d{9})$")
_PART = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class CheckpointError(FlotillaError):
    """A checkpoint that cannot be used; the message names the checkpoint and what is wrong."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpoint:
    """A verified checkpoint: its step, meta data and tensors per part."""

    path: Path
    step: int
    meta: dict[str, Any]
    parts: dict[str, dict[str, torch.Tensor]]
    scheduler: dict[str, Any] | None = None  # the LR scheduler's state_dict, if one was saved


def plain_state(value: Any, what: str, path: str = "") -> Any:
    """``value`` as JSON data (tuples become lists) if it holds only plain values -- mappings with
    string keys, lists, tuples, strings, ints, floats, bools, None -- else a
    :class:`CheckpointError` naming ``what`` and where the first other value sits."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointError(f"{what}: key {key!r} at {path or 'top level'} is not a string")
            out[key] = plain_state(item, what, f"{path}.{key}" if path else key)
        return out
    if isinstance(value, (list, tuple)):
        return [plain_state(item, what, f"{path}[{i}]") for i, item in enumerate(value)]
    raise CheckpointError(
        f"{what}: {path or 'the state'} holds a {type(value).__name__}; only plain numbers, strings, "
        "lists and mappings are checkpointed (never pickle)"
    )


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def tensors_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """safetensors bytes of ``tensors`` (contiguous CPU copies; shared storage is fine)."""
    plain = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    return st_save(plain)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


STALE_TMP_S = 3600.0  # a temporary directory this old is abandoned whoever wrote it


def _abandoned(tmp: Path) -> bool:
    """Whether ``tmp`` (``.ckpt-<step>.<pid>[.old].<pid>.tmp``) was left by a writer that is gone:
    this process's own, one whose process is not running here, or one untouched for
    ``STALE_TMP_S``.  (A live writer's is kept: a former rank 0 may still be writing its last
    checkpoint in the background while the new rank 0 writes its first.)"""
    pid_text = tmp.name.removesuffix(".tmp").rsplit(".", 1)[-1]
    try:
        pid = int(pid_text)
        if pid == os.getpid() or time.time() - tmp.stat().st_mtime > STALE_TMP_S:
            return True
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError, FileNotFoundError):
        return True
    except PermissionError:  # (running, as another user)
        return False
    return False


def write_checkpoint(
    directory: str | os.PathLike[str],
    *,
    step: int,
    parts: Mapping[str, Mapping[str, torch.Tensor]],
    meta: Mapping[str, Any],
    fingerprint: str,
    keep: int = 3,
    scheduler: Mapping[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of ``step`` atomically and prune to the ``keep`` newest; its path.
    ``scheduler``: an LR scheduler's ``state_dict``, kept as JSON in the manifest (plain values only)."""
    plain_scheduler = None if scheduler is None else plain_state(scheduler, "scheduler state")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"ckpt-{step:09d}"
    for stale in root.glob(".ckpt-*.tmp"):  # left by a killed writer
        if _abandoned(stale):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".ckpt-{step:09d}.{os.getpid()}.tmp"
    tmp.mkdir()
    files: dict[str, dict[str, Any]] = {}
    for name, tensors in parts.items():
        if not _PART.match(name):
            raise ValueError(f"checkpoint part name {name!r} must match {_PART.pattern}")
        data = tensors_bytes(tensors)
        atomic_write_bytes(tmp / f"{name}.safetensors", data)
        files[name] = {"bytes": len(data), "blake2b": _digest(data)}
    manifest = {
        "format": FORMAT,
        "step": step,
        "fingerprint": fingerprint,
        "meta": dict(meta),
        "files": files,
    }
    if plain_scheduler is not None:
        manifest["scheduler"] = plain_scheduler
    atomic_write_bytes(tmp / MANIFEST, (json.dumps(manifest, sort_keys=True) + "\n").encode())
    if final.exists():  # the same step again (e.g. after a resume): swap, never half-delete
        aside = root / f".ckpt-{step:09d}.old.{os.getpid()}.tmp"
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    prune(root, keep)
    return final


def list_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """Complete-looking checkpoints (a ``ckpt-*`` directory with a manifest), oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def prune(directory: Path, keep: int) -> None:
    """Remove all but the ``keep`` newest checkpoints."""
    found = list_checkpoints(directory)
    for old in found[: max(0, len(found) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: unreadable manifest ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: not a flotilla checkpoint manifest (format {FORMAT})")
    return manifest


def load_checkpoint(path: str | os.PathLike[str], *, fingerprint: str | None) -> Checkpoint:
    """Read and verify one checkpoint; ``fingerprint`` (if given) must match the writer's config."""
    ckpt = Path(path)
    manifest = _read_manifest(ckpt)
    if fingerprint is not None and manifest.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"checkpoint {ckpt}: written by another configuration (fingerprint "
            f"{manifest.get('fingerprint')!r}, this run {fingerprint!r}); use a new checkpoint.dir"
        )
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, info in dict(manifest.get("files", {})).items():
        file = ckpt / f"{name}.safetensors"
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"checkpoint {ckpt}: missing file {file.name} ({exc})") from exc
        if len(data) != info.get("bytes") or _digest(data) != info.get("blake2b"):
            raise CheckpointError(
                f"checkpoint {ckpt}: {file.name} is truncated or corrupt "
                f"({len(data)} bytes, manifest says {info.get('bytes')})"
            )
        parts[name] = st_load(data)
    scheduler = manifest.get("scheduler")
    if scheduler is not None and not isinstance(scheduler, dict):
        raise CheckpointError(f"checkpoint {ckpt}: the scheduler state in {MANIFEST} is not a mapping")
    return Checkpoint(
        path=ckpt,
        step=int(manifest["step"]),
        meta=dict(manifest.get("meta", {})),
        parts=parts,
        scheduler=scheduler,
    )


def latest_checkpoint(directory: str | os.PathLike[str], *, fingerprint: str | None) -> Checkpoint:
    """The newest checkpoint under ``directory``, verified; an error if there is none."""
    found = list_checkpoints(directory)
    if not found:
        raise CheckpointError(f"no checkpoint under {directory} (expected ckpt-<step>/manifest.json)")
    return load_checkpoint(found[-1], fingerprint=fingerprint)


def export_model(path: str | os.PathLike[str], state_dict: Mapping[str, torch.Tensor]) -> Path:
    """Write the trained model as one plain ``state_dict`` in safetensors, atomically."""
    target = Path(path)
    atomic_write_bytes(target, tensors_bytes(state_dict))
    return target
