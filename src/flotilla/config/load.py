"""Loading a run configuration: YAML text -> ``--set`` overrides -> validated :class:`RunConfig`.

Invariants:
- every failure surfaces as one :class:`~flotilla.core.errors.ConfigError` whose message is a single
  line naming the field (dotted path, list indices included, union tags left out) and what is
  allowed -- never a pydantic or YAML traceback (errors are raised ``from None``);
- YAML is read with a safe loader that also rejects duplicate keys;
- overrides are applied to the plain data before validation, in order, on a deep copy; their paths
  are checked against the schema first, so a typo is reported as an unknown key of the override.
"""

from __future__ import annotations

import copy
import os
import re
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from flotilla.config.paths import resolve_task_path
from flotilla.config.revocations import resolve_trace_path
from flotilla.config.schema import CONFIG_ERROR_TYPE, RunConfig
from flotilla.core.errors import ConfigError

__all__ = ["apply_overrides", "format_validation_error", "load_config", "validate_config"]

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


def _walk(loc: Sequence[Any], *, tags_in_loc: bool = True) -> tuple[list[str], Any]:
    """Follow ``loc`` from :class:`RunConfig`: (displayed path parts, node at the end or None)."""
    node: Any = RunConfig
    parts: list[str] = []
    for item in loc:
        shown = True
        if node is not None:
            node, shown = _child(node, item, tags_in_loc=tags_in_loc)
        if shown:
            parts.append(str(item))
    return parts, node


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


def _format_one(error: Mapping[str, Any]) -> str:
    loc = tuple(error["loc"])
    parts, node = _walk(loc)
    return _format_shape(error, loc, parts, node) or _format_value(error, ".".join(parts) or "config", node)


def _format_shape(error: Mapping[str, Any], loc: tuple[Any, ...], parts: list[str], node: Any) -> str | None:
    """Problems of structure: unknown keys and tags, missing fields, flotilla's own checks."""
    kind, ctx, path = error["type"], error.get("ctx") or {}, ".".join(parts) or "config"
    if kind == "extra_forbidden":
        parent_parts, parent = _walk(loc[:-1])
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


def format_validation_error(err: ValidationError) -> str:
    """One line per problem, joined with ``"; "`` (at most five, then a count of the rest)."""
    lines = [_format_one(error) for error in err.errors(include_url=False)]
    if len(lines) > _MAX_PROBLEMS:
        lines = lines[:_MAX_PROBLEMS] + [f"... and {len(lines) - _MAX_PROBLEMS} more problems"]
    return re.sub(r"\s*\n\s*", " ", "; ".join(lines))


# ------------------------------------------------------------------------------------- overrides


def _parse_override(override: str) -> tuple[list[str], Any]:
    key, sep, raw = override.partition("=")
    if not sep:
        raise ConfigError(f"override {override!r}: expected PATH=VALUE, e.g. job.steps=50")
    keys = key.strip().split(".")
    if not all(keys):
        raise ConfigError(f"override {override!r}: empty component in path {key.strip()!r}")
    try:
        value = yaml.load(raw, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        raise ConfigError(
            f"override {override!r}: value is not valid YAML "
            f"({_one_line(getattr(err, 'problem', None) or err)})"
        ) from None
    return keys, value


def _check_override_path(keys: list[str], override: str) -> None:
    node: Any = RunConfig
    for depth, key in enumerate(keys):
        parent = node
        node, _ = _child(parent, key, tags_in_loc=False)
        if node is not None:
            continue
        if get_origin(parent) is dict:  # a free mapping (e.g. job.task_args): any key below it
            return
        here = ".".join(keys[: depth + 1])
        allowed = _allowed_keys(parent)
        if allowed:
            what = "unknown key" if depth else "unknown section"
            raise ConfigError(f"override {override!r}: {here}: {what}; allowed: {_joined(allowed)}")
        if get_origin(parent) in (list, tuple):
            raise ConfigError(f"override {override!r}: {here}: expected a list index (0, 1, ...)")
        raise ConfigError(
            f"override {override!r}: {here}: unknown key; {'.'.join(keys[:depth])} is a value, not a section"
        )


def _slot(node: Any, key: str, where: str, override: str) -> Any:
    """The key or list index of ``key`` inside ``node`` (a mapping or a list)."""
    if isinstance(node, list):
        index = _as_index(key)
        if index is None or index >= len(node):
            raise ConfigError(
                f"override {override!r}: {where}: index out of range (the list has {len(node)} items)"
            )
        return index
    if not isinstance(node, dict):
        parent = where.rpartition(".")[0] or "config"
        raise ConfigError(f"override {override!r}: {parent} is {_show(node)}, not a mapping or list")
    return key


def _assign(root: dict[str, Any], keys: list[str], value: Any, override: str) -> None:
    node: Any = root
    for depth, key in enumerate(keys):
        where = ".".join(keys[: depth + 1])
        slot = _slot(node, key, where, override)
        if depth == len(keys) - 1:
            node[slot] = value
            return
        if isinstance(node, dict) and node.get(slot) is None:
            if _as_index(keys[depth + 1]) is not None:
                raise ConfigError(f"override {override!r}: {where} is not set; cannot index it")
            node[slot] = {}
        node = node[slot]


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str] | str) -> dict[str, Any]:
    """Return a deep copy of ``data`` with each ``"a.b.c=value"`` applied in order.

    ``value`` is parsed as a YAML scalar or flow collection (``50``, ``adam``, ``[{speed: 1}]``,
    ``null``); numeric path components index lists (``cluster.workers.1.speed=0.5``).  Missing
    intermediate mappings are created.  Paths are checked against :class:`RunConfig` first.
    """
    result = copy.deepcopy(dict(data))
    for override in [overrides] if isinstance(overrides, str) else overrides:
        keys, value = _parse_override(override)
        _check_override_path(keys, override)
        _assign(result, keys, value, override)
    return result


# ----------------------------------------------------------------------------------------- YAML


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_scalar(key_node)  # keys are compared as written
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def _one_line(text: object) -> str:
    return re.sub(r"\s+", " ", str(text)).strip()


def _parse_yaml(text: str, source: str) -> dict[str, Any]:
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
        problem = getattr(err, "problem", None) or err
        raise ConfigError(f"{where}: invalid YAML: {_one_line(problem)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: top level must be a mapping with sections "
            f"{_joined(RunConfig.model_fields)} (got {_show(data)})"
        )
    return data


def _read(path: str | os.PathLike[str]) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except FileNotFoundError:
        raise ConfigError(f"{os.fspath(path)}: no such config file") from None
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or _one_line(err)
        raise ConfigError(f"{os.fspath(path)}: cannot read config ({reason})") from None


def validate_config(data: Mapping[str, Any]) -> RunConfig:
    """Validate plain data into a :class:`RunConfig`, or raise a one-line :class:`ConfigError`."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = (), *, text: str | None = None
) -> RunConfig:
    """Load a run configuration from a YAML file (or ``text``), apply overrides, validate.

    With neither ``path`` nor ``text`` the configuration is built from ``overrides`` alone.
    Raises :class:`ConfigError` (one line) for every problem with the file, overrides or values.
    """
    if path is not None and text is not None:
        raise TypeError("load_config: pass path or text, not both")
    source = os.fspath(path) if path is not None else "<text>"
    if path is not None:
        text = _read(path)
    data = _parse_yaml(text, source) if text is not None else {}
    data = apply_overrides(data, overrides)
    base = os.path.dirname(os.path.abspath(os.fspath(path))) if path is not None else os.getcwd()
    return validate_config(resolve_trace_path(resolve_task_path(data, base), base))
