"""Character-level text data from the Python standard library's own source files ("pysource").

The corpus ships with every Python installation, so the data set needs no download:

- files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, except the directories
  ``site-packages``, ``dist-packages``, ``test``, ``tests``, ``idlelib``, ``__pycache__`` and the
  build-specific ``_sysconfigdata*`` modules, read in sorted order of their relative path parts and
  concatenated (separated by a newline) until ``max_bytes`` characters are collected;
- vocabulary: a FIXED alphabet of 96 characters, ``"\\n"`` followed by the printable ASCII range
  ``" "`` .. ``"~"``; a tab becomes four spaces, any other character becomes ``"?"``.  So the number
  of classes never depends on the files read;
- split: the first ``1 - test_fraction`` of the text is the training text, the rest the test text
  (no window straddles the two);
- samples: ``num_samples`` windows of ``seq_len + 1`` characters at positions drawn from
  ``numpy.random.default_rng(seed)`` inside each split (train and test in proportion); ``x`` is the
  first ``seq_len`` characters and ``y`` the next character at every position (``x`` shifted by
  one), both int64 ``[N, seq_len]``.

Everything is a deterministic function of the arguments and of the installed standard library.
``TextDataset`` offers the attributes builders read from ``ArrayDataset`` (``x_train`` ...,
``num_classes``, ``input_shape``, ``train_tensors``); its labels are per position, so it is a
separate type (``ArrayDataset`` requires one label per sample).
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from flotilla.core.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["VOCAB", "TextDataset", "decode", "encode", "load_pysource", "stdlib_text"]

VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
_UNKNOWN = VOCAB.index("?")
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})
_TABLE = np.full(256, _UNKNOWN, dtype=np.int64)  # latin-1 byte -> id
for _i, _ch in enumerate(VOCAB):
    _TABLE[ord(_ch)] = _i


def encode(text: str) -> np.ndarray:
    """Character ids (int64) of ``text``; tabs become four spaces, unknown characters ``"?"``."""
    text = text.replace("\t", "    ")
    raw = np.frombuffer(text.encode("latin-1", errors="replace"), dtype=np.uint8)
    return _TABLE[raw]


def decode(ids: np.ndarray | list[int]) -> str:
    """Inverse of ``encode`` on the vocabulary."""
    return "".join(VOCAB[int(i)] for i in ids)


def _source_files(directory: Path) -> Iterator[Path]:
    """``*.py`` files in sorted order of their relative path parts, lazily (skipped dirs pruned)."""
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False):
            if entry.name not in _SKIP_DIRS:
                yield from _source_files(Path(entry.path))
        elif entry.name.endswith(".py") and not entry.name.startswith("_sysconfigdata"):
            yield Path(entry.path)


@lru_cache(maxsize=4)
def stdlib_text(max_bytes: int = 2_000_000, root: str | None = None) -> str:
    """The concatenated standard-library source, at most ``max_bytes`` characters (cached)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise ConfigError(f"pysource: the standard library directory {base} does not exist")
    parts, size = [], 0
    for path in _source_files(base):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        parts.append(text)
        size += len(text) + 1
        if size >= max_bytes:
            break
    joined = "\n".join(parts)[:max_bytes]
    if len(joined) < 10_000:
        raise ConfigError(f"pysource: found only {len(joined)} characters of Python source under {base}")
    return joined


@dataclass(frozen=True)
class TextDataset:
    """Next-character windows: ``x``/``y`` int64 ``[N, seq_len]``, ``y`` is ``x`` shifted by one."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    vocab: str = VOCAB

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if x.dtype != np.int64 or y.dtype != np.int64 or x.shape != y.shape or x.ndim != 2:
                raise ConfigError(f"x_{split}/y_{split} must be int64 arrays of one shape [N, T]")
            if len(x) and (min(x.min(), y.min()) < 0 or max(x.max(), y.max()) >= self.num_classes):
                raise ConfigError(f"x_{split}/y_{split} ids must lie in [0, {self.num_classes})")

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (int(self.x_train.shape[1]),)

    @property
    def seq_len(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def num_train(self) -> int:
        return len(self.x_train)

    def train_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        return torch.from_numpy(self.x_train), torch.from_numpy(self.y_train)

    def test_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        return torch.from_numpy(self.x_test), torch.from_numpy(self.y_test)


def _windows(
    ids: np.ndarray, count: int, seq_len: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    if len(ids) < seq_len + 2:
        raise ConfigError(f"pysource: a split of {len(ids)} characters is too short for seq_len {seq_len}")
    starts = rng.integers(0, len(ids) - seq_len - 1, size=count)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    win = ids[idx]
    return np.ascontiguousarray(win[:, :-1]), np.ascontiguousarray(win[:, 1:])


def load_pysource(
    num_samples: int = 4000,
    test_fraction: float = 0.2,
    seed: int = 0,
    seq_len: int = 64,
    max_bytes: int = 2_000_000,
) -> TextDataset:
    """``num_samples`` windows of ``seq_len`` characters (train and test in proportion)."""
    if num_samples < 2:
        raise ConfigError(f"num_samples must be >= 2, got {num_samples}")
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if not 1 <= seq_len <= 4096:
        raise ConfigError(f"seq_len must be in [1, 4096], got {seq_len}")
    ids = encode(stdlib_text(int(max_bytes)))
    cut = int(len(ids) * (1.0 - test_fraction))
    num_train = max(1, min(num_samples - 1, int(num_samples * (1.0 - test_fraction))))
    rng = np.random.default_rng(np.random.SeedSequence([seed, num_samples, seq_len]))
    x_train, y_train = _windows(ids[:cut], num_train, seq_len, rng)
    x_test, y_test = _windows(ids[cut:], num_samples - num_train, seq_len, rng)
    return TextDataset(x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test, num_classes=len(VOCAB))
