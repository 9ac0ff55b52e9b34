"""The ``strategy`` section: the strategy registry as a tagged union on ``kind``.

Every strategy declares its settings model in its own module and registers a spec
(``sync/registry.py``): a section is validated against the model of its ``kind`` -- a registered
kind, an import name (``./my_strategy.py:SPEC``) or an installed entry point -- so adding a
strategy needs no edit here.  Errors name ``strategy.<field>`` and the allowed values
(``config/messages.py`` walks the registry as it walks a static union).

The built-in settings models are re-exported for the code and tests that name them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import WrapValidator

from flotilla.core.errors import ConfigError
from flotilla.core.settings import fail
from flotilla.sync import registry
from flotilla.sync.allreduce_settings import AllReduceStrategy
from flotilla.sync.pipeline_settings import PipelineStrategy
from flotilla.sync.pr_settings import PartialReduceStrategy
from flotilla.sync.ps_settings import (
    ASPConsistency,
    BSPConsistency,
    Consistency,
    PSStrategy,
    SSPConsistency,
    WSPConsistency,
)
from flotilla.sync.spec import StrategySettings

__all__ = [
    "ASPConsistency",
    "AllReduceStrategy",
    "BSPConsistency",
    "Consistency",
    "PSStrategy",
    "PartialReduceStrategy",
    "PipelineStrategy",
    "SSPConsistency",
    "Strategy",
    "StrategySettings",
    "WSPConsistency",
]


def _by_registry(value: Any, handler: Callable[[Any], Any]) -> StrategySettings:
    """A ``strategy:`` section -> its kind's settings (nested errors keep their field paths)."""
    if isinstance(value, StrategySettings):
        return value
    try:
        return registry.settings_of(value)
    except ConfigError as exc:
        raise fail(str(exc).removeprefix("strategy.kind: ").removeprefix("strategy: "), "kind") from None


class RegistryUnion:
    """Marker of the strategy field for ``config/messages.py`` (its members are the registry's)."""

    discriminator = "kind"

    @staticmethod
    def members() -> dict[str, type[StrategySettings]]:
        return {name: spec.settings for name, spec in registry.known().items()}


# ``Any`` for serialisation: a settings object dumps as its own class (all of its fields)
Strategy = Annotated[Any, WrapValidator(_by_registry), RegistryUnion]
