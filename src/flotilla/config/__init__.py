"""Config (rank 6): typed, validated run configuration loaded from YAML with ``--set`` overrides.

It also builds the package configs the runtime takes (``ClusterConfig.spec()``; a strategy's own
come from its spec's ``package``, ``sync/spec.py``).
Every invalid input raises :class:`flotilla.core.errors.ConfigError` with a one-line message that
names the field and what is allowed.
"""

from flotilla.config.load import apply_overrides, load_config, validate_config
from flotilla.config.messages import format_validation_error
from flotilla.config.schema import (
    AdamOptimizer,
    AllReduceStrategy,
    ClusterConfig,
    DatasetConfig,
    JobConfig,
    ModelConfig,
    Optimizer,
    PipelineStrategy,
    PSStrategy,
    ReportConfig,
    RunConfig,
    SGDOptimizer,
    Size,
    Strategy,
    WorkerDefaults,
    WorkerEntry,
    WorkerSpec,
    format_size,
    parse_size,
)

__all__ = [
    "AdamOptimizer",
    "AllReduceStrategy",
    "ClusterConfig",
    "DatasetConfig",
    "JobConfig",
    "ModelConfig",
    "PipelineStrategy",
    "PSStrategy",
    "Optimizer",
    "ReportConfig",
    "RunConfig",
    "SGDOptimizer",
    "Size",
    "Strategy",
    "WorkerDefaults",
    "WorkerEntry",
    "WorkerSpec",
    "apply_overrides",
    "format_size",
    "format_validation_error",
    "load_config",
    "parse_size",
    "validate_config",
]
