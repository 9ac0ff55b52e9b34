"""One-line messages for invalid configs: a walk of the :class:`RunConfig` schema plus formatting.

:func:`format_validation_error` turns a pydantic ``ValidationError`` into one line per problem that
names the field (dotted path, list indices included, union tags left out) and what is allowed.  The
schema walk (``_walk``, ``_child``, ``_allowed_keys``) is shared with :mod:`flotilla.config.load`,
which checks ``--set`` override paths with it.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from flotilla.config.schema import CONFIG_ERROR_TYPE, RunConfig
from flotilla.config.strategy import RegistryUnion

__all__ = ["format_validation_error"]

_MAX_PROBLEMS = 5

# ------------------------------------------------------------------------------------ schema walk


@dataclass(frozen=True)
class _Tagged:
    """A discriminated union of models: ``members`` maps each tag value to its model."""

    discriminator: str
    members: dict[str, type[BaseModel]]


def _strip(annotation: Any) -> Any:
    """Drop ``Annotated`` metadata and ``None`` from ``Optional``."""
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation = get_args(annotation)[0]
            continue
        if origin in (Union, types.UnionType):
            args = [arg for arg in get_args(annotation) if arg is not type(None)]
            if len(args) == 1:
                annotation = args[0]
                continue
        return annotation


def _field_node(field: FieldInfo) -> Any:
    if RegistryUnion in field.metadata:  # the strategy section: the registry's kinds, as of now
        return _Tagged(RegistryUnion.discriminator, dict(RegistryUnion.members()))
    annotation = _strip(field.annotation)
    if not isinstance(field.discriminator, str):
        return annotation
    name = field.discriminator
    members = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    return _Tagged(name, {member.model_fields[name].default: member for member in members})


def _is_model(node: Any) -> bool:
    return isinstance(node, type) and issubclass(node, BaseModel)


def _child(node: Any, item: Any, *, tags_in_loc: bool) -> tuple[Any, bool]:
    """One step down the schema: (next node or None if unknown, whether ``item`` is displayed)."""
    if isinstance(node, _Tagged):
        if tags_in_loc and item in node.members:
            return node.members[item], False
        for member in node.members.values():
            if item in member.model_fields:
                return _field_node(member.model_fields[item]), True
        return None, True
    if _is_model(node):
        field = node.model_fields.get(item) if isinstance(item, str) else None
        return (_field_node(field) if field is not None else None), True
    if get_origin(node) in (list, tuple) and _as_index(item) is not None:
        args = get_args(node)
        if get_origin(node) is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            index = _as_index(item)
            return (_strip(args[index]) if index is not None and index < len(args) else None), True
        return _strip(args[0]), True
    return None, True


def _walk(loc: Sequence[Any], *, tags_in_loc: bool = True, data: Any = None) -> tuple[list[str], Any]:
    """Follow ``loc`` from :class:`RunConfig`: (displayed path parts, node at the end or None).
    With the validated input ``data``, a tagged section whose tag is not in ``loc`` (the strategy
    registry's) is narrowed to the model of the kind the data names."""
    node: Any = RunConfig
    parts: list[str] = []
    for item in loc:
        shown = True
        if node is not None:
            if isinstance(node, _Tagged) and item not in node.members:
                node = _narrowed(node, data)
            node, shown = _child(node, item, tags_in_loc=tags_in_loc)
        data = _sub(data, item)
        if shown:
            parts.append(str(item))
    return parts, _narrowed(node, data)


def _narrowed(node: Any, data: Any) -> Any:
    if isinstance(node, _Tagged) and isinstance(data, Mapping):
        return node.members.get(str(data.get(node.discriminator)), node)
    return node


def _sub(data: Any, item: Any) -> Any:
    if isinstance(data, Mapping):
        return data.get(item)
    index = _as_index(item)
    if isinstance(data, (list, tuple)) and index is not None and index < len(data):
        return data[index]
    return None


def _allowed_keys(node: Any) -> list[str]:
    if isinstance(node, _Tagged):
        return sorted({key for member in node.members.values() for key in member.model_fields})
    return sorted(node.model_fields) if _is_model(node) else []


def _as_index(item: Any) -> int | None:
    if isinstance(item, int) and not isinstance(item, bool):
        return item if item >= 0 else None
    return int(item) if isinstance(item, str) and item.isdigit() else None


# ------------------------------------------------------------------------------ error formatting

_BOUNDS = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}
_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "tuple_type": "a list",
}


def _show(value: Any) -> str:
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def _fixed_tuple_length(node: Any) -> int | None:
    args = get_args(node) if get_origin(node) is tuple else ()
    return len(args) if args and Ellipsis not in args else None


def _joined(values: Iterable[Any]) -> str:
    return ", ".join(str(value) for value in values)


def _format_one(error: Mapping[str, Any], data: Any = None) -> str:
    loc = tuple(error["loc"])
    parts, node = _walk(loc, data=data)
    return _format_shape(error, loc, parts, node, data) or _format_value(
        error, ".".join(parts) or "config", node
    )


def _format_shape(
    error: Mapping[str, Any], loc: tuple[Any, ...], parts: list[str], node: Any, data: Any = None
) -> str | None:
    """Problems of structure: unknown keys and tags, missing fields, flotilla's own checks."""
    kind, ctx, path = error["type"], error.get("ctx") or {}, ".".join(parts) or "config"
    if kind == "extra_forbidden":
        parent_parts, parent = _walk(loc[:-1], data=data)
        what = "unknown key" if parent_parts else "unknown section"
        return f"{path}: {what}; allowed: {_joined(_allowed_keys(parent))}"
    if kind in ("union_tag_invalid", "union_tag_not_found") and isinstance(node, _Tagged):
        problem = f"unknown {ctx.get('tag')!r}" if kind == "union_tag_invalid" else "missing"
        return f"{path}.{node.discriminator}: {problem}; allowed: {_joined(node.members)}"
    if kind == CONFIG_ERROR_TYPE:
        field_path = ".".join(parts + [ctx["field"]]) if "field" in ctx else path
        return f"{field_path}: {ctx.get('message', error['msg'])}"
    if kind != "missing":
        return None
    size = _fixed_tuple_length(_walk(loc[:-1])[1]) if loc else None
    if size is not None:
        got = _show(error["input"])
        return f"{'.'.join(parts[:-1])}: must have exactly {size} items (got {got})"
    literals = get_args(node) if get_origin(node) is Literal else ()
    return f"{path}: missing (required)" + (f"; allowed: {_joined(literals)}" if literals else "")


def _format_value(error: Mapping[str, Any], path: str, node: Any) -> str:
    """Problems of a value: choice, bound, type, pattern, length."""
    kind, ctx = error["type"], error.get("ctx") or {}
    got = f"(got {_show(error.get('input'))})"
    if kind == "literal_error":
        literals = get_args(node) if get_origin(node) is Literal else ()
        allowed = _joined(literals) if literals else ctx.get("expected")
        return f"{path}: unknown {_show(error.get('input'))}; allowed: {allowed}"
    if kind in _BOUNDS:
        key, op = _BOUNDS[kind]
        return f"{path}: must be {op} {_number(ctx.get(key))} {got}"
    if kind in _TYPE_WORDS:
        return f"{path}: must be {_TYPE_WORDS[kind]} {got}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        keys = _allowed_keys(node)
        with_keys = f" with keys {_joined(keys)}" if keys else ""
        return f"{path}: must be a mapping{with_keys} {got}"
    if kind == "string_pattern_mismatch":
        return f"{path}: must match {ctx.get('pattern')} {got}"
    if kind in ("too_short", "too_long"):
        bound = "at least" if kind == "too_short" else "at most"
        limit = ctx.get("min_length" if kind == "too_short" else "max_length")
        return f"{path}: must have {bound} {limit} item{'s' if limit != 1 else ''} {got}"
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{path}: {message} {got}"


def format_validation_error(err: ValidationError, data: Any = None) -> str:
    """One line per problem, joined with ``"; "`` (at most five, then a count of the rest);
    ``data``: the input that was validated (names the fields of the kind a section chose)."""
    lines = [_format_one(error, data) for error in err.errors(include_url=False)]
    if len(lines) > _MAX_PROBLEMS:
        lines = lines[:_MAX_PROBLEMS] + [f"... and {len(lines) - _MAX_PROBLEMS} more problems"]
    return re.sub(r"\s*\n\s*", " ", "; ".join(lines))
