"""Data: in-memory datasets (MNIST-1D generated offline, Gaussian blobs) and the batch sampler.

Importing this package does not import torch (the sampler is pure numpy, and the datasets import
torch only when tensors are asked for), so the simulator may use the sampler.
"""

from flotilla.data.datasets import (
    DATASETS,
    ArrayDataset,
    default_cache_dir,
    load_dataset,
    load_mnist1d,
    load_synthetic,
)
from flotilla.data.sampler import GlobalBatchSampler, epoch_permutation, shard_bounds

__all__ = [
    "DATASETS",
    "ArrayDataset",
    "GlobalBatchSampler",
    "default_cache_dir",
    "epoch_permutation",
    "load_dataset",
    "load_mnist1d",
    "load_synthetic",
    "shard_bounds",
]
