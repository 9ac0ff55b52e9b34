"""Versioned weight stash of one pipeline stage (SPEC §3.3, weight stashing and vertical sync).

The decisions -- which passes use a stashed version, when a version may be dropped, how many
versions are alive at most -- are pure and live in ``flotilla.pipeline.stash_plan`` (re-exported
here: ``StashPlan``, ``plan_stash``).  This module executes them on tensors:

- ``WeightStash`` holds the versions as tensors.  Version v is never copied while it is the newest:
  a stashed forward of the newest version uses *aliases* of the live parameter storage.  When an
  update v -> v+1 runs while v is still needed (a pending backward, or under vertical sync a later
  forward), the live parameters first move to a fresh copy of their storage and the old storage
  stays behind as version v (copy-on-write).  So the number of weight copies alive at any time is
  exactly the number of versions the schedule needs (``validate.analyze(...).peak_weight_versions``);
  a version is dropped right after its last use.

Aliases have their own autograd version counter, so the in-place optimizer update of the live
tensors never invalidates a stashed version; correctness rests on the copy-on-write above (the
runtime tests check it with weight digests per pass).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from flotilla.core.errors import ConfigError
from flotilla.pipeline.stash_plan import StashPlan, plan_stash

__all__ = ["StashPlan", "WeightStash", "plan_stash"]


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor sharing ``tensor``'s storage but with its own autograd version counter."""
    with torch.no_grad():
        base = tensor.detach()
        out = torch.empty(0, dtype=base.dtype, device=base.device)
        return out.set_(base.untyped_storage(), base.storage_offset(), base.size(), base.stride())


class WeightStash:
    """The versions of one stage's parameters; the live ``params`` are the optimizer's (newest)."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = tuple(params)
        self.newest = 0
        self._versions: dict[int, tuple[torch.Tensor, ...]] = {}
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self.peak_copies = 1

    @property
    def stashed_versions(self) -> tuple[int, ...]:
        return tuple(sorted(self._versions))

    @property
    def num_copies(self) -> int:
        """Weight copies alive: the live one plus every stashed version that no longer shares it."""
        return 1 + sum(1 for v in self._versions if v != self.newest)

    def tensors(self, version: int) -> tuple[torch.Tensor, ...]:
        """The tensors of ``version`` (aliases of the live storage when it is the newest)."""
        if version not in self._versions:
            if version != self.newest:
                raise ConfigError(
                    f"weight version {version} is not stashed (newest {self.newest}, "
                    f"stashed {self.stashed_versions})"
                )
            self._versions[version] = tuple(_alias(p) for p in self.params)
        return self._versions[version]

    def before_update(self, keep_current: bool) -> None:
        """Call right before the optimizer updates the live weights in place.  ``keep_current``:
        the newest version is still needed afterwards, so it is preserved (copy-on-write)."""
        if keep_current:
            self.tensors(self.newest)
            with torch.no_grad():
                for p in self.params:
                    p.data = p.data.clone()
        else:
            self._versions.pop(self.newest, None)

    def after_update(self) -> None:
        """The live weights are now version ``newest + 1``."""
        self.newest += 1
        self.peak_copies = max(self.peak_copies, self.num_copies)

    def release(self, version: int) -> None:
        """Drop ``version`` (after its last use); a no-op when it is not stashed."""
        self._versions.pop(version, None)

    def note_peak(self) -> None:
        self.peak_copies = max(self.peak_copies, self.num_copies)
