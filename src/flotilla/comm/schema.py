"""Schemas of the message plane: the exact fields of request and reply headers, and the
per-op body schemas handlers register (``{field: type or tuple of types}``).

Invariants: a header check raises ``MessageRejected("malformed")``; a body check raises
``MessageRejected("schema")`` naming the field.  ``bool`` never passes for ``int``; an ``int``
passes for ``float``; ``None`` in a schema stands for ``type(None)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from flotilla.core.errors import ConfigError, MessageRejected

__all__ = [
    "MAX_NAME_CHARS",
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

Schema = Mapping[str, "type | tuple[type, ...] | None"]


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
def normalise_schema(schema: Schema | None) -> dict[str, tuple[type, ...]] | None:
    if schema is None:
        return None
    out: dict[str, tuple[type, ...]] = {}
    for name, types in schema.items():
        tup = types if isinstance(types, tuple) else (types,)
        tup = tuple(type(None) if t is None else t for t in tup)
        if not isinstance(name, str) or not tup or not all(isinstance(t, type) for t in tup):
            raise ConfigError(f"schema[{name!r}]: must map a str to a type or tuple of types")
        out[name] = tup
    return out


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    if type(value) is bool:
        return bool in types
    return isinstance(value, types) or (float in types and type(value) is int)


def check_body(body: Mapping[str, Any], schema: Mapping[str, tuple[type, ...]]) -> None:
    """Raise ``MessageRejected("schema")`` naming the first missing, extra or mistyped field."""
    for name in schema:
        if name not in body:
            raise MessageRejected("schema", f"missing field {name!r}")
    for name, value in body.items():
        if name not in schema:
            raise MessageRejected("schema", f"unexpected field {name!r}")
        if not _type_ok(value, schema[name]):
            allowed = ", ".join(t.__name__ for t in schema[name])
            raise MessageRejected("schema", f"field {name!r} is {type(value).__name__}, expected {allowed}")
