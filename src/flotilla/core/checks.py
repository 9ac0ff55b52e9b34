"""Validators for config dataclasses: one place for "must be an int >= 1" and friends.

Every check raises ``error`` (default :class:`~flotilla.core.errors.ConfigError`) with a one-line
message naming ``owner.field``, what is allowed and what was given, e.g.
``SSP.staleness must be an int >= 0, got -1``, and returns the value (so a ``__post_init__`` may
use it inline).  Pure: no I/O, no torch.

Invariants:
- ``bool`` is never accepted where an int or a number is asked for (``True`` is not a count);
- numbers must be finite (no NaN / inf) unless ``finite=False``.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import TypeVar

from flotilla.core.errors import ConfigError

__all__ = ["require_choice", "require_instance", "require_int", "require_number"]

T = TypeVar("T")


def _int_bounds(lo: int | None, hi: int | None) -> str:
    parts = ([f">= {lo}"] if lo is not None else []) + ([f"<= {hi}"] if hi is not None else [])
    return " and ".join(parts)


def require_int(
    owner: str,
    field: str,
    value: object,
    *,
    min: int | None = 0,
    max: int | None = None,
    error: type[ConfigError] = ConfigError,
) -> int:
    """``value`` if it is an int (not a bool) in ``[min, max]`` (``None``: unbounded)."""
    ok = type(value) is int and (min is None or value >= min) and (max is None or value <= max)
    if not ok:
        bounds = _int_bounds(min, max)
        raise error(f"{owner}.{field} must be an int{' ' + bounds if bounds else ''}, got {value!r}")
    assert isinstance(value, int)
    return value


def require_number(
    owner: str,
    field: str,
    value: object,
    *,
    min: float | None = None,
    gt: float | None = None,
    max: float | None = None,
    finite: bool = True,
    error: type[ConfigError] = ConfigError,
) -> float:
    """``value`` if it is an int or float (not a bool), finite, ``>= min``, ``> gt``, ``<= max``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        assert isinstance(value, (int, float))
        ok = (
            (not finite or math.isfinite(value))
            and (min is None or value >= min)
            and (gt is None or value > gt)
            and (max is None or value <= max)
        )
    if not ok:
        parts = [p for p in (_num(">=", min), _num(">", gt), _num("<=", max)) if p]
        what = ("a finite number" if finite else "a number") + (" " + " and ".join(parts) if parts else "")
        raise error(f"{owner}.{field} must be {what}, got {value!r}")
    assert isinstance(value, (int, float))
    return value


def _num(op: str, bound: float | None) -> str:
    return "" if bound is None else f"{op} {bound:g}"


def require_choice(
    owner: str, field: str, value: T, allowed: Collection[T], *, error: type[ConfigError] = ConfigError
) -> T:
    """``value`` if it is one of ``allowed`` (the message lists them)."""
    if value not in allowed:
        raise error(f"{owner}.{field} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")
    return value


def require_instance(
    owner: str,
    field: str,
    value: object,
    types: tuple[type, ...],
    *,
    error: type[ConfigError] = ConfigError,
) -> None:
    """Raise unless ``value`` is an instance of one of ``types`` (the message names them)."""
    if not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types)
        raise error(f"{owner}.{field} must be {names}, got {value!r}")
