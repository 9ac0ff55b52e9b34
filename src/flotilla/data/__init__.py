"""Data: in-memory datasets (MNIST-1D generated offline, Gaussian blobs, Python source text) and the
global-batch sampler.

The package loads its members lazily (PEP 562), so importing the pure sampler
(``flotilla.data.sampler``) loads neither the dataset cache (files, a lock, logging) nor torch: the
simulator may use the sampler.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DATASETS": "flotilla.data.datasets",
    "ArrayDataset": "flotilla.data.datasets",
    "default_cache_dir": "flotilla.data.datasets",
    "load_dataset": "flotilla.data.datasets",
    "load_mnist1d": "flotilla.data.datasets",
    "load_synthetic": "flotilla.data.datasets",
    "GlobalBatchSampler": "flotilla.data.sampler",
    "epoch_permutation": "flotilla.data.sampler",
    "shard_bounds": "flotilla.data.sampler",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flotilla.data' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
