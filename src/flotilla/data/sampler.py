"""Global-batch sampling that survives membership changes (pure: numpy only, no torch, no I/O).

The job, not the worker, owns the data order.  Each *data epoch* is one permutation of
``range(num_samples)`` seeded by ``(seed, data_epoch)``.  Step ``k`` consumes the ``k``-th
contiguous slice of ``global_batch_size`` indices of its epoch's permutation (the last slice of an
epoch is smaller unless ``drop_last``), and that *global batch* is split across the ranks of the
membership view the step runs under into near-equal contiguous parts, with ``np.array_split``
semantics (the first ``n % world_size`` ranks get one extra sample); with ``min_shard`` > 1 (a
model with BatchNorm, which cannot train on one sample) a batch too short for every rank to get
that many is split over the first ranks only (``shard_bounds``).

Invariants (property-tested in ``tests/unit/test_sampler.py``):

- the shards of one step are disjoint and their concatenation in rank order is the global batch;
- whatever world size each step uses, every sample is used exactly once per data epoch across the
  job (with ``drop_last`` the ``num_samples % global_batch_size`` left-over samples are skipped);
- everything is a deterministic function of ``(num_samples, global_batch_size, seed, drop_last)``
  and the step, so every worker computes the same plan with no communication, and a worker that
  joins at step ``k`` needs only ``k`` and the current view.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from flotilla.core.errors import ConfigError

__all__ = ["GlobalBatchSampler", "epoch_permutation", "shard_bounds"]


@lru_cache(maxsize=8)
def _cached_permutation(num_samples: int, seed: int, data_epoch: int) -> np.ndarray:
    rng = np.random.default_rng(np.random.SeedSequence([seed, data_epoch]))
    perm = rng.permutation(num_samples).astype(np.int64, copy=False)
    perm.flags.writeable = False  # shared through the cache: nobody may mutate it
    return perm


def epoch_permutation(num_samples: int, seed: int, data_epoch: int) -> np.ndarray:
    """The (read-only) permutation of ``range(num_samples)`` used in ``data_epoch``."""
    if num_samples < 1 or seed < 0 or data_epoch < 0:
        raise ValueError(
            f"need num_samples >= 1, seed >= 0, data_epoch >= 0; got {num_samples}, {seed}, {data_epoch}"
        )
    return _cached_permutation(int(num_samples), int(seed), int(data_epoch))


def shard_bounds(batch_len: int, rank: int, world_size: int, min_part: int = 1) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s part of ``batch_len`` items split like ``np.array_split``.

    ``min_part`` > 1 (a model that cannot train on fewer samples: BatchNorm in training mode needs
    2): a batch too short to give every rank that many is split like ``np.array_split`` over the
    first ``max(1, batch_len // min_part)`` ranks only, and the others get none (an empty part at
    the batch's end) -- no part then holds fewer than ``min_part`` unless the batch itself does."""
    if min_part < 1:
        raise ValueError(f"min_part must be >= 1, got {min_part}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if batch_len < 0:
        raise ValueError(f"batch_len must be >= 0, got {batch_len}")
    if min_part > 1 and batch_len < min_part * world_size:
        world_size = max(1, batch_len // min_part)  # (the ranks that get a part)
        if rank >= world_size:
            return batch_len, batch_len
    base, extra = divmod(batch_len, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True, kw_only=True, slots=True)
class GlobalBatchSampler:
    """Deterministic per-step global batches, split across the ranks of each step's view.

    ``num_samples``: dataset size (>= 1).  ``global_batch_size``: samples consumed per step by the
    whole job (>= 1).  ``seed``: >= 0.  ``drop_last``: skip the short last step of each epoch
    (then ``global_batch_size`` must not exceed ``num_samples``).
    """

    num_samples: int
    global_batch_size: int
    seed: int = 0
    drop_last: bool = False
    min_shard: int = 1  # the fewest samples a non-empty shard holds (``shard_bounds``' min_part)

    def __post_init__(self) -> None:
        _check_int("num_samples", self.num_samples, 1)
        _check_int("global_batch_size", self.global_batch_size, 1)
        _check_int("seed", self.seed, 0)
        _check_int("min_shard", self.min_shard, 1)
        if not isinstance(self.drop_last, bool):
            raise ConfigError(f"drop_last must be True or False, got {self.drop_last!r}")
        if self.drop_last and self.global_batch_size > self.num_samples:
            raise ConfigError(
                f"global_batch_size ({self.global_batch_size}) must be <= num_samples "
                f"({self.num_samples}) when drop_last=True"
            )

    @property
    def steps_per_epoch(self) -> int:
        """Steps in one data epoch: ``ceil(N / B)``, or ``floor(N / B)`` with ``drop_last``."""
        if self.drop_last:
            return self.num_samples // self.global_batch_size
        return -(-self.num_samples // self.global_batch_size)

    def data_epoch(self, step: int) -> int:
        """The data epoch that global step ``step`` (>= 0) belongs to."""
        self._check_step(step)
        return step // self.steps_per_epoch

    def batch_len(self, step: int) -> int:
        """Number of samples in the global batch of ``step`` (smaller on an epoch's last step)."""
        start, stop = self._slice(step)
        return stop - start

    def global_batch(self, step: int) -> np.ndarray:
        """The indices (int64, a fresh array) the whole job consumes at ``step``."""
        start, stop = self._slice(step)
        perm = epoch_permutation(self.num_samples, self.seed, self.data_epoch(step))
        return perm[start:stop].copy()

    def shard(self, step: int, rank: int, world_size: int) -> np.ndarray:
        """``rank``'s contiguous part of ``global_batch(step)`` in a view of ``world_size`` ranks.

        May be empty when the global batch has fewer samples than ``world_size`` (than
        ``min_shard * world_size``: then the last ranks get none, ``shard_bounds``).
        """
        start, stop = self._slice(step)
        lo, hi = shard_bounds(stop - start, rank, world_size, self.min_shard)
        perm = epoch_permutation(self.num_samples, self.seed, self.data_epoch(step))
        return perm[start + lo : start + hi].copy()

    def _slice(self, step: int) -> tuple[int, int]:
        self._check_step(step)
        start = (step % self.steps_per_epoch) * self.global_batch_size
        return start, min(start + self.global_batch_size, self.num_samples)

    @staticmethod
    def _check_step(step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
