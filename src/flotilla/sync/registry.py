"""The strategy registry: kind -> :class:`~flotilla.sync.spec.StrategySpec`.

A kind is found, in this order, among
1. the registered specs: the built-in ones below (one line each) and any ``register(spec)``;
2. an **import name** -- ``"./my_strategy.py:SPEC"`` (a file, relative to the config file's
   directory) or ``"my_package.strategies:SPEC"`` -- whose attribute is a ``StrategySpec``; it is
   imported (once per process) and registered under the name as written;
3. an installed package's **entry point** in the group ``flotilla.strategies`` whose name is the
   kind and whose object is a ``StrategySpec``.

:func:`settings_of` validates a ``strategy:`` section against its kind's settings model (the
configuration's strategy union is this registry); :func:`build` makes a worker's strategy.
Errors are one-line :class:`~flotilla.core.errors.ConfigError` naming ``strategy.kind`` and the
known kinds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module, metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flotilla.core.errors import ConfigError
from flotilla.core.imports import import_by_name, is_import_name, why
from flotilla.sync.base import SyncStrategy
from flotilla.sync.spec import StrategyContext, StrategySettings, StrategySpec

__all__ = [
    "ENTRY_POINT_GROUP",
    "Factory",
    "StrategyContext",
    "build",
    "kinds",
    "known",
    "register",
    "settings_of",
    "spec_of",
    "specs",
    "unregister",
]

ENTRY_POINT_GROUP = "flotilla.strategies"
Factory = Callable[[nn.Module, torch.optim.Optimizer, Any, StrategyContext], SyncStrategy]
_SPECS: dict[str, StrategySpec] = {}
_BY_NAME: dict[str, StrategySpec] = {}  # import names and entry points already resolved


def register(spec: StrategySpec | str, factory: Factory | None = None, *, replace: bool = False) -> None:
    """Make ``spec.kind`` known; refuses to shadow an existing kind unless ``replace``.
    (``register("kind", factory)``: a spec with no settings of its own, for tests and quick toys.)"""
    if isinstance(spec, str):
        if not spec or not spec.isidentifier():
            raise ConfigError(f"strategy kind must be an identifier, got {spec!r}")
        spec = StrategySpec(kind=spec, build=factory)
    if not isinstance(spec, StrategySpec):
        raise ConfigError(f"register() takes a StrategySpec, got {type(spec).__name__}")
    if spec.kind in _SPECS and not replace:
        raise ConfigError(f"strategy kind {spec.kind!r} is already registered")
    _SPECS[spec.kind] = spec


def unregister(kind: str) -> None:
    _SPECS.pop(kind, None)
    _BY_NAME.pop(kind, None)


def kinds() -> tuple[str, ...]:
    """The registered kinds (import names and entry points not yet used are not listed)."""
    return tuple(sorted(_SPECS))


def specs() -> tuple[StrategySpec, ...]:
    return tuple(_SPECS[k] for k in kinds())


def known() -> dict[str, StrategySpec]:
    """Every kind this process knows: the registered ones and the names already resolved."""
    return {**_BY_NAME, **_SPECS}


def _entry_point(kind: str) -> StrategySpec | None:
    try:
        found = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == kind]
    except Exception:  # (a broken installed distribution must not hide the built-in kinds)
        return None
    if not found:
        return None
    try:
        obj = found[0].load()
    except Exception as exc:
        raise ConfigError(f"strategy.kind: entry point {kind!r} failed to load: {why(exc)}") from None
    return _as_spec(obj, kind)


def _as_spec(obj: Any, name: str) -> StrategySpec:
    if isinstance(obj, StrategySpec):
        return obj
    inner = getattr(obj, "SPEC", None)  # (a module or class that carries its spec)
    if isinstance(inner, StrategySpec):
        return inner
    raise ConfigError(
        f"strategy.kind: {name!r} is a {type(obj).__name__}, not a StrategySpec "
        "(see docs/strategies.md: a module declares SPEC = StrategySpec(...))"
    )


def spec_of(kind: str, *, base_dir: Path | None = None) -> StrategySpec:
    """The spec of ``kind``: registered, an import name, or an entry point (see the module doc)."""
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"strategy.kind: expected a name, got {kind!r}; registered: {', '.join(kinds())}")
    if kind in _SPECS:
        return _SPECS[kind]
    if kind in _BY_NAME:
        return _BY_NAME[kind]
    if is_import_name(kind):
        obj = import_by_name(
            kind, label=f"strategy.kind: {kind!r}", base_dir=base_dir, error=ConfigError, example="SPEC"
        )
        spec = _as_spec(obj, kind)
    else:
        found = _entry_point(kind)
        if found is None:
            raise ConfigError(
                f"strategy.kind: unknown {kind!r}; allowed: {', '.join(kinds())} "
                "(or an import name: './my_strategy.py:SPEC', 'package.module:SPEC')"
            )
        spec = found
    _BY_NAME[kind] = spec
    return spec


def settings_of(section: Mapping[str, Any] | StrategySettings) -> StrategySettings:
    """Validate a ``strategy:`` section (a mapping with a ``kind``) against its
    kind's settings model; pydantic's ValidationError names the field; ConfigError for the kind."""
    if isinstance(section, StrategySettings):
        return section
    if not isinstance(section, Mapping):
        raise ConfigError(f"strategy: expected a mapping with a 'kind', got {type(section).__name__}")
    if "kind" not in section:
        raise ConfigError(f"strategy.kind: missing; allowed: {', '.join(kinds())} (or an import name)")
    kind = section["kind"]
    spec = spec_of(kind)
    body = {k: v for k, v in section.items() if k != "kind"}
    settings = spec.settings.model_validate(body)
    if settings.kind != kind:
        settings = settings.model_copy(update={"kind": kind})
    return settings


def build(
    kind: str, model: nn.Module, optimizer: torch.optim.Optimizer, config: Any, ctx: StrategyContext
) -> SyncStrategy:
    """A new strategy of ``kind`` built from ``config`` (its settings, or a built-in's package
    config); ConfigError naming the known kinds if unknown, or if the kind has no worker strategy."""
    spec = spec_of(kind)
    if spec.build is None:
        raise ConfigError(f"strategy.kind {kind!r} has no data-parallel worker: run it with `flotilla run`")
    return spec.build(model, optimizer, config, ctx)


# The built-in strategies: modules of this package, each declaring ``SPEC`` (one line a strategy).
BUILT_IN = (
    "allreduce_settings",
    "pr_settings",
    "ps_settings",
    "pipeline_settings",
    "hetpipe",
    "diloco",
    "adpsgd",
    "adaptive",
)
for _module in BUILT_IN:
    register(import_module(f"flotilla.sync.{_module}").SPEC)
