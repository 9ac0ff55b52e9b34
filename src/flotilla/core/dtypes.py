"""The one dtype whitelist: every tensor dtype flotilla sends, stores or shards, by name.

Pure (no torch): names are torch's without the ``torch.`` prefix; ``flotilla.comm.codec`` maps
them to ``torch.dtype`` objects.  Subsets by use:

- :data:`WIRE_DTYPES` -- tensor frames on the message plane (``comm/codec.py``) and PS keys
  (``ps/sharding.py`` sizes them);
- :data:`REAL_DTYPES` -- state broadcast over a collective (``comm/collective.py``): no complex;
- :data:`FLOAT_DTYPES` -- parameters kept on the parameter server (``ps/wire.py``, snapshots).

Adding a dtype here adds it everywhere at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

__all__ = ["DTYPE_ITEMSIZE", "FLOAT_DTYPES", "REAL_DTYPES", "WIRE_DTYPES", "canonical_dtype"]

_TABLE: Final[tuple[tuple[str, int, str], ...]] = (
    ("bool", 1, "bool"),
    ("uint8", 1, "int"),
    ("int8", 1, "int"),
    ("int16", 2, "int"),
    ("int32", 4, "int"),
    ("int64", 8, "int"),
    ("float16", 2, "float"),
    ("bfloat16", 2, "float"),
    ("float32", 4, "float"),
    ("float64", 8, "float"),
    ("complex64", 8, "complex"),
    ("complex128", 16, "complex"),
)

DTYPE_ITEMSIZE: Final[Mapping[str, int]] = MappingProxyType({name: size for name, size, _ in _TABLE})
"""Bytes per element of every whitelisted dtype."""
WIRE_DTYPES: Final[frozenset[str]] = frozenset(DTYPE_ITEMSIZE)
REAL_DTYPES: Final[frozenset[str]] = frozenset(name for name, _, kind in _TABLE if kind != "complex")
FLOAT_DTYPES: Final[frozenset[str]] = frozenset(name for name, _, kind in _TABLE if kind == "float")


def canonical_dtype(dtype: str) -> str:
    """``"torch.float32"`` -> ``"float32"`` (names are kept without the prefix)."""
    return dtype.removeprefix("torch.")
