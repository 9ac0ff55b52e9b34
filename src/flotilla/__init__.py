"""flotilla: PyTorch-native training on heterogeneous, transient clusters.

The public Python surface (``flotilla.api``), loaded lazily so that ``import flotilla`` (and the
torch-free simulator) stays light::

    flotilla.make_config(source, overrides=())      # a validated RunConfig from YAML path / dict
    flotilla.run(cfg, task=..., report_dir=...) # run it locally, return the summary
    flotilla.Task, flotilla.ClassificationTask  # optional base classes of a user task
    flotilla.load_task(name, args)              # build a task by "module:Class" / "file.py:Class"
    flotilla.StrategySpec, flotilla.SyncStrategy, ...  # a strategy of one's own (docs/strategies.md)

Layers (bottom to top, a layer imports only layers below it) are described in
``docs/architecture.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "make_config": "flotilla.api",
    "run": "flotilla.api",
    "Task": "flotilla.trainer.task",
    "ClassificationTask": "flotilla.trainer.task",
    "LanguageModelTask": "flotilla.trainer.task",
    "load_task": "flotilla.trainer.task_load",
    "RunConfig": "flotilla.config",
    "FlotillaError": "flotilla.core.errors",
    "ConfigError": "flotilla.core.errors",
    # writing a strategy (docs/strategies.md)
    "StrategySpec": "flotilla.sync.spec",
    "StrategySettings": "flotilla.sync.spec",
    "StrategyContext": "flotilla.sync.spec",
    "SyncStrategy": "flotilla.sync.base",
    "Traits": "flotilla.sync.base",
    "Regime": "flotilla.sync.base",
    "Outcome": "flotilla.sync.base",
    "Proposal": "flotilla.sync.base",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flotilla' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
