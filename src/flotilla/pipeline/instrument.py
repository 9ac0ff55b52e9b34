"""Instrumentation of a pipeline stage run: what ``StageRuntime`` records (SPEC §3.3 tests).

- ``StageResult``: the measured timeline, per pass the weight version named and served
  (``VersionRecord``), version digests, peak in-flight microbatches, peak activation bytes held
  for pending backwards, peak weight copies, emulated compute/sleep and wall time;
- ``weights_digest``: a short hash of the exact bytes of a set of tensors (to prove that a
  backward used the very weights of its forward);
- ``SavedBytes``/``saved_hooks``: count the bytes autograd saves during a forward through
  ``saved_tensors_hooks`` (weights excluded, each storage once).

Recording never changes what the stage computes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from flotilla.pipeline.timeline import TimelineEntry

__all__ = ["SavedBytes", "StageResult", "VersionRecord", "saved_hooks", "weights_digest"]


@dataclass(frozen=True, slots=True)
class VersionRecord:
    """One pass: ``kind`` "F"/"B", the version the schedule named, the version the stash served,
    and (with ``record_versions``) the digest of the weights the pass actually used."""

    kind: str
    microbatch_idx: int
    scheduled_version: int
    used_version: int
    digest: str | None


@dataclass(slots=True)
class StageResult:
    stage_idx: int
    timeline: list[TimelineEntry] = field(default_factory=list)
    versions: list[VersionRecord] = field(default_factory=list)
    version_digests: dict[int, str] = field(default_factory=dict)
    step_losses: dict[int, float] = field(default_factory=dict)
    peak_in_flight: int = 0
    peak_activation_bytes: int = 0
    peak_weight_copies: int = 1
    compute_s: float = 0.0
    slept_s: float = 0.0
    wall_s: float = 0.0


def weights_digest(tensors: Iterable[torch.Tensor]) -> str:
    """Short hash of the exact bytes of ``tensors`` (instrumentation only)."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class SavedBytes:
    """Counts bytes of tensors autograd saves during one forward, weights excluded, storages once."""

    def __init__(self, weight_ptrs: set[int]) -> None:
        self.weight_ptrs, self.total = weight_ptrs, 0
        self.seen: set[int] = set()

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.weight_ptrs and ptr not in self.seen:
            self.seen.add(ptr)
            self.total += storage.nbytes()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """(a ``saved_tensors_hooks`` pack hook) count ``t``; keep it detached: the tensor itself
        would make a saved *output* hold its own ``grad_fn`` (a reference cycle, pytorch#115255),
        so a pass dropped without its backward would live until the cycle collector ran."""
        self.add(t)
        return t.detach()


class saved_hooks:
    """``saved_tensors_hooks`` feeding a ``SavedBytes`` counter, or nothing when it is None."""

    def __init__(self, counter: SavedBytes | None) -> None:
        self._ctx = (
            torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t)
            if counter is not None
            else None
        )

    def __enter__(self) -> None:
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
