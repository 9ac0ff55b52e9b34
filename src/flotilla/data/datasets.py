"""In-memory datasets: MNIST-1D (generated offline) and Gaussian blobs, plus a name registry.

Invariants:

- every loader is a deterministic function of its arguments and returns an ``ArrayDataset`` of
  float32 inputs and int64 labels in ``[0, num_classes)``;
- MNIST-1D is *generated* with the installed ``mnist1d`` package (``make_dataset``); its
  download/pickle path is never used.  The arrays are cached as an ``.npz`` (loaded with
  ``allow_pickle=False``) whose name is derived from every generation argument, written
  atomically (temp file + rename) under a file lock, so workers that start at once generate it
  once and never read a half-written file;
- ``mnist1d`` seeds the *global* ``random``/``numpy`` RNGs; their states are saved and restored
  around generation, so callers' RNG streams are unchanged;
- ``torch`` and ``mnist1d`` are imported lazily: importing this module is cheap.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from flotilla.core.atomic_io import atomic_write_bytes
from flotilla.core.errors import ConfigError
from flotilla.core.log import get_logger
from flotilla.data.text import load_pysource

if TYPE_CHECKING:
    import torch

__all__ = [
    "ArrayDataset",
    "DATASETS",
    "default_cache_dir",
    "load_dataset",
    "load_mnist1d",
    "load_synthetic",
]

_log = get_logger("data")
_CACHE_FORMAT = 1
_LOCK_TIMEOUT_S = 300.0
_GLOBAL_RNG_LOCK = threading.Lock()


@dataclass(frozen=True)
class ArrayDataset:
    """Train/test arrays: ``x`` float32 ``[N, C, L]`` or ``[N, D]``, ``y`` int64 ``[N]``."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        if self.num_classes < 1:
            raise ConfigError(f"num_classes must be >= 1, got {self.num_classes}")
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if x.dtype != np.float32 or y.dtype != np.int64:
                raise ConfigError(f"x_{split}/y_{split} must be float32/int64, got {x.dtype}/{y.dtype}")
            if x.ndim < 2 or y.ndim != 1 or len(x) != len(y):
                raise ConfigError(f"x_{split} {x.shape} and y_{split} {y.shape} do not match")
            if len(y) and (y.min() < 0 or y.max() >= self.num_classes):
                raise ConfigError(f"y_{split} labels must lie in [0, {self.num_classes})")
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise ConfigError(f"x_train {self.x_train.shape} and x_test {self.x_test.shape} differ")

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample (without the batch dimension)."""
        return tuple(int(d) for d in self.x_train.shape[1:])

    @property
    def num_train(self) -> int:
        return len(self.y_train)

    def train_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` torch tensors sharing memory with the training arrays."""
        import torch

        return torch.from_numpy(self.x_train), torch.from_numpy(self.y_train)

    def test_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` torch tensors sharing memory with the test arrays."""
        import torch

        return torch.from_numpy(self.x_test), torch.from_numpy(self.y_test)


def default_cache_dir() -> Path:
    """``$FLOTILLA_CACHE`` if set, else ``~/.cache/flotilla``."""
    env = os.environ.get("FLOTILLA_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "flotilla"


def _check_fraction(test_fraction: float) -> None:
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction}")


# ----------------------------------------------------------------------------------- MNIST-1D


def _cache_path(cache_dir: Path, num_samples: int, test_fraction: float, seed: int) -> Path:
    """Cache file name: a digest of the arguments and of the generator's version.

    The generator's other settings are the package defaults, fixed by its version, so the cache
    hit path never has to import ``mnist1d`` (which pulls in scipy and matplotlib).
    """
    from importlib.metadata import version

    key = {
        "num_samples": num_samples,
        "test_fraction": test_fraction,
        "seed": seed,
        "format": _CACHE_FORMAT,
        "mnist1d": version("mnist1d"),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / f"mnist1d_n{num_samples}_s{seed}_{digest}.npz"


def _generate_mnist1d(num_samples: int, test_fraction: float, seed: int) -> dict[str, np.ndarray]:
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = num_samples
    args.train_split = 1.0 - test_fraction
    args.seed = seed
    with _GLOBAL_RNG_LOCK:
        py_state, np_state = random.getstate(), np.random.get_state()
        try:
            raw = make_dataset(args)
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
    length = int(args.final_seq_length)
    return {
        "x_train": np.asarray(raw["x"], dtype=np.float32).reshape(-1, 1, length),
        "y_train": np.asarray(raw["y"], dtype=np.int64),
        "x_test": np.asarray(raw["x_test"], dtype=np.float32).reshape(-1, 1, length),
        "y_test": np.asarray(raw["y_test"], dtype=np.int64),
    }


def _read_npz(path: Path) -> dict[str, np.ndarray] | None:
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in ("x_train", "y_train", "x_test", "y_test")}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as exc:  # unreadable cache: regenerate it
        _log.warning("ignoring unreadable dataset cache %s: %s", path, exc)
        return None


class _FileLock:
    """An advisory ``flock`` with a timeout; degrades to no lock where ``fcntl`` is missing."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        self._path, self._timeout_s, self._fd = path, timeout_s, -1

    def __enter__(self) -> bool:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - non-POSIX
            return False
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing releases the flock
            self._fd = -1


def load_mnist1d(
    num_samples: int = 25000,
    test_fraction: float = 0.2,
    seed: int = 42,
    cache_dir: str | Path | None = None,
) -> ArrayDataset:
    """MNIST-1D generated offline: x float32 ``[N, 1, 40]``, 10 classes.

    ``num_samples`` is rounded down to a multiple of 10 (the generator makes equal classes); the
    first ``int(N * (1 - test_fraction))`` samples are the training split.  Cached in
    ``cache_dir`` (default :func:`default_cache_dir`).
    """
    if num_samples < 10:
        raise ConfigError(f"num_samples must be >= 10, got {num_samples}")
    _check_fraction(test_fraction)
    spec = (int(num_samples), float(test_fraction), int(seed))
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = _cache_path(directory, *spec)
    arrays = _read_npz(path)
    if arrays is None:
        with _FileLock(path.with_name(f".{path.name}.lock"), _LOCK_TIMEOUT_S) as locked:
            if not locked:
                _log.warning("dataset lock %s not acquired; generating without it", path)
            arrays = _read_npz(path)  # another worker may have written it meanwhile
            if arrays is None:
                start = time.perf_counter()
                arrays = _generate_mnist1d(*spec)
                buf = io.BytesIO()
                np.savez(buf, **arrays)  # type: ignore[arg-type]
                atomic_write_bytes(path, buf.getvalue())
                _log.info("generated %s in %.1f s", path, time.perf_counter() - start)
    return ArrayDataset(**arrays, num_classes=10)


# ------------------------------------------------------------------------------ Gaussian blobs


def load_synthetic(
    num_samples: int = 2000,
    num_features: int = 20,
    num_classes: int = 4,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> ArrayDataset:
    """Well-separated Gaussian blobs: x float32 ``[N, num_features]``, balanced classes.

    Class centres are drawn at distance ~3 sigma per feature, so a linear model separates them
    almost perfectly; a deterministic function of the arguments.
    """
    if num_samples < 2:
        raise ConfigError(f"num_samples must be >= 2, got {num_samples}")
    if num_features < 1:
        raise ConfigError(f"num_features must be >= 1, got {num_features}")
    if num_classes < 2:
        raise ConfigError(f"num_classes must be >= 2, got {num_classes}")
    _check_fraction(test_fraction)
    rng = np.random.default_rng(np.random.SeedSequence([seed, num_samples, num_features]))
    centres = rng.normal(0.0, 3.0, size=(num_classes, num_features))
    y = rng.permutation(np.arange(num_samples) % num_classes).astype(np.int64)
    x = (centres[y] + rng.normal(0.0, 1.0, size=(num_samples, num_features))).astype(np.float32)
    num_train = max(1, min(num_samples - 1, int(num_samples * (1.0 - test_fraction))))
    return ArrayDataset(
        x_train=x[:num_train],
        y_train=y[:num_train],
        x_test=x[num_train:],
        y_test=y[num_train:],
        num_classes=num_classes,
    )


# ------------------------------------------------------------------------------------ registry

DATASETS: dict[str, Callable[..., Any]] = {
    "mnist1d": load_mnist1d,
    "synthetic": load_synthetic,
    "pysource": load_pysource,
}


def load_dataset(name: str, **kw: Any) -> ArrayDataset:
    """Load a dataset by name (``"mnist1d"`` or ``"synthetic"``) with loader keyword arguments."""
    try:
        loader = DATASETS[name]
    except KeyError:
        raise ValueError(f"unknown dataset {name!r}; allowed: {', '.join(sorted(DATASETS))}") from None
    return loader(**kw)
