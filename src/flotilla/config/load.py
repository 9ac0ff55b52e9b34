"""Loading a run configuration: YAML text -> ``--set`` overrides -> validated :class:`RunConfig`.

Invariants:
- every failure surfaces as one :class:`~flotilla.core.errors.ConfigError` whose message is a single
  line naming the field and what is allowed (validation errors are worded by
  :mod:`flotilla.config.messages`) -- never a pydantic or YAML traceback (errors are raised
  ``from None``);
- YAML is read with a safe loader that also rejects duplicate keys;
- overrides are applied to the plain data before validation, in order, on a deep copy; their paths
  are checked against the schema first, so a typo is reported as an unknown key of the override.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, get_origin

import yaml
from pydantic import ValidationError

from flotilla.config.messages import (
    _allowed_keys,
    _as_index,
    _child,
    _joined,
    _show,
    _Tagged,
    format_validation_error,
)
from flotilla.config.paths import resolve_strategy_path, resolve_task_path
from flotilla.config.revocations import resolve_trace_path
from flotilla.config.schema import RunConfig
from flotilla.core.errors import ConfigError
from flotilla.sync import registry

__all__ = ["apply_overrides", "format_validation_error", "load_config", "validate_config"]


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


def _check_override_path(keys: list[str], override: str, data: Any = None) -> None:
    node: Any = RunConfig
    for depth, key in enumerate(keys):
        parent = node
        node, _ = _child(parent, key, tags_in_loc=False)
        data = data.get(key) if isinstance(data, dict) else None
        if isinstance(node, _Tagged) and isinstance(data, dict):  # e.g. strategy: its kind's fields
            node = node.members.get(str(data.get(node.discriminator)), node)
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


def apply_overrides(
    data: Mapping[str, Any], overrides: Sequence[str] | str, *, checked: bool = True
) -> dict[str, Any]:
    """Return a deep copy of ``data`` with each ``"a.b.c=value"`` applied in order.

    ``value`` is parsed as a YAML scalar or flow collection (``50``, ``adam``, ``[{speed: 1}]``,
    ``null``); numeric path components index lists (``cluster.workers.1.speed=0.5``).  Missing
    intermediate mappings are created.  Paths are checked against :class:`RunConfig` first (inside
    a tagged section such as ``strategy``, against the fields of the kind it names) -- unless
    ``checked`` is False (another schema checks the result: a sizing file's, ``sim/sizing.py``).
    """
    result = copy.deepcopy(dict(data))
    for override in [overrides] if isinstance(overrides, str) else overrides:
        keys, value = _parse_override(override)
        if checked:
            _check_override_path(keys, override, result)
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
        raise ConfigError(format_validation_error(err, data)) from None


def _know_strategy(data: dict[str, Any]) -> dict[str, Any]:
    """Resolve the file's strategy kind (an import name: a user's strategy) so that ``--set``
    paths into its settings are checked against them; a kind that does not resolve is reported
    by the validation that follows."""
    st = data.get("strategy")
    if isinstance(st, dict) and isinstance(st.get("kind"), str):
        try:
            registry.spec_of(st["kind"])
        except ConfigError:
            pass
    return data


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
    base = os.path.dirname(os.path.abspath(os.fspath(path))) if path is not None else os.getcwd()
    data = _know_strategy(resolve_strategy_path(data, base))  # (overrides may name its fields)
    data = apply_overrides(data, overrides)
    data = resolve_strategy_path(resolve_task_path(data, base), base)
    try:
        return validate_config(resolve_trace_path(data, base))
    except ConfigError as err:
        raise ConfigError(_kind_hint(str(err), overrides)) from None


def _kind_hint(message: str, overrides: Sequence[str]) -> str:
    """A ``--set SECTION.kind=K`` that left the file's other keys of that section unknown to
    ``K``: the message says how to replace the whole section instead."""
    for item in overrides:
        key, _, kind = item.partition("=")
        section = key.strip()[: -len(".kind")] if key.strip().endswith(".kind") else ""
        if section and f"{section}." in message and "unknown key" in message:
            return (
                f"{message} (--set {section}.kind keeps the section's other keys: replace the whole "
                f"section instead, e.g. --set '{section}={{kind: {kind.strip()}}}')"
            )
    return message
