"""Schemas of the message plane: the exact fields of request and reply headers, and the
per-op body schemas handlers register (``{field: type or tuple of types}``).

Invariants: a header check raises ``MessageRejected("malformed")``; a body check raises
``MessageRejected("schema")`` naming the field.  ``bool`` never passes for ``int``; an ``int``
passes for ``float``; ``None`` in a schema stands for ``type(None)``.  An :class:`IntRange` in a
schema is an ``int`` field with stated bounds, checked before any handler sees the value
(``MessageRejected("schema")`` naming the field and the bounds): one absurd value, even correctly
signed, never reaches the state it would index or compare against.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flotilla.core.errors import ConfigError, MessageRejected

__all__ = [
    "MAX_NAME_CHARS",
    "IntRange",
    "is_int",
    "is_name",
    "is_rid",
    "MAX_RID_CHARS",
    "REPLY_FIELDS",
    "REQUEST_FIELDS",
    "Schema",
    "check_body",
    "check_fields",
    "normalise_schema",
]

MAX_NAME_CHARS = 256
MAX_RID_CHARS = 64


@dataclass(frozen=True, slots=True)
class IntRange:
    """A schema entry: an ``int`` (never a ``bool``) in ``[lo, hi]``."""

    lo: int
    hi: int

    def holds(self, v: Any) -> bool:
        return is_int(v) and self.lo <= v <= self.hi


Schema = Mapping[str, "type | IntRange | tuple[type | IntRange, ...] | None"]


# ----------------------------------------------------------------------------- header fields
def is_int(v: Any) -> bool:
    return type(v) is int


def is_name(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= MAX_NAME_CHARS


def is_rid(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= MAX_RID_CHARS


def _body(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) for k in v)


def _ts(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


REQUEST_FIELDS: dict[str, Callable[[Any], bool]] = {
    "v": is_int,
    "op": is_name,
    "sender": is_name,
    "seq": lambda v: is_int(v) and v >= 0,
    "ts": _ts,
    "rid": lambda v: is_rid(v) and v != "",
    "body": _body,
    "tensors": lambda v: True,
}
REPLY_FIELDS: dict[str, Callable[[Any], bool]] = {
    "v": is_int,
    "rid": is_rid,
    "sender": is_name,
    "ts": _ts,
    "ok": lambda v: type(v) is bool,
    "body": _body,
    "tensors": lambda v: True,
}


def check_fields(header: dict[str, Any], spec: Mapping[str, Callable[[Any], bool]]) -> None:
    if set(header) != set(spec):
        extra, missing = sorted(set(header) - set(spec)), sorted(set(spec) - set(header))
        raise MessageRejected("malformed", f"header fields: missing {missing}, unexpected {extra}")
    for name, ok in spec.items():
        if not ok(header[name]):
            raise MessageRejected("malformed", f"header.{name} has a bad value or type")


# ----------------------------------------------------------------------------- body schema
def normalise_schema(schema: Schema | None) -> dict[str, tuple[type | IntRange, ...]] | None:
    if schema is None:
        return None
    out: dict[str, tuple[type | IntRange, ...]] = {}
    for name, types in schema.items():
        tup = types if isinstance(types, tuple) else (types,)
        tup = tuple(type(None) if t is None else t for t in tup)
        if not isinstance(name, str) or not tup or not all(isinstance(t, (type, IntRange)) for t in tup):
            raise ConfigError(f"schema[{name!r}]: must map a str to a type or tuple of types")
        out[name] = tup
    return out


def _type_ok(value: Any, entries: tuple[type | IntRange, ...]) -> bool:
    if any(isinstance(t, IntRange) and t.holds(value) for t in entries):
        return True
    types = tuple(t for t in entries if isinstance(t, type))
    if type(value) is bool:
        return bool in types
    return isinstance(value, types) or (float in types and type(value) is int)


def _allowed(entries: tuple[type | IntRange, ...]) -> str:
    return ", ".join(f"int in [{t.lo}, {t.hi}]" if isinstance(t, IntRange) else t.__name__ for t in entries)


def check_body(body: Mapping[str, Any], schema: Mapping[str, tuple[type | IntRange, ...]]) -> None:
    """Raise ``MessageRejected("schema")`` naming the first missing, extra or mistyped field."""
    for name in schema:
        if name not in body:
            raise MessageRejected("schema", f"missing field {name!r}")
    for name, value in body.items():
        if name not in schema:
            raise MessageRejected("schema", f"unexpected field {name!r}")
        if not _type_ok(value, schema[name]):
            what = repr(value)[:40] if is_int(value) else type(value).__name__
            raise MessageRejected("schema", f"field {name!r} is {what}, expected {_allowed(schema[name])}")
