"""Typed run configuration: the pydantic v2 models behind a flotilla YAML file.

A run file has four sections -- ``cluster``, ``job``, ``strategy``, ``report`` -- each a model in
this module, and :class:`RunConfig` is their root.  Loading, ``--set`` overrides and one-line error
messages live in :mod:`flotilla.config.load`.

Invariants:
- every model forbids unknown keys and is frozen (collections are tuples), so a validated
  ``RunConfig`` can be shared and hashed;
- sizes (``*_bytes``) accept an int or a string such as ``"512MiB"`` / ``"1.5GB"`` and are stored as
  whole, positive numbers of bytes; floats must be finite;
- choices are tagged unions on ``kind`` (:data:`Strategy`, :data:`Optimizer`); adding a strategy
  means writing its model with a ``kind: Literal[...]`` field and adding it to ``Strategy``;
- custom validators raise ``PydanticCustomError(CONFIG_ERROR_TYPE, "{message}", ctx)`` where ``ctx``
  may carry ``field`` (a sub-field of the failing model) so the formatter can name it precisely.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from flotilla.core.errors import ConfigError

__all__ = [
    "AdamOptimizer",
    "AllReduceStrategy",
    "ClusterConfig",
    "DatasetConfig",
    "JobConfig",
    "ModelConfig",
    "Optimizer",
    "ReportConfig",
    "RunConfig",
    "SGDOptimizer",
    "Size",
    "Strategy",
    "WorkerDefaults",
    "WorkerEntry",
    "WorkerSpec",
    "format_size",
    "parse_size",
]

CONFIG_ERROR_TYPE = "flotilla_config"

# ---------------------------------------------------------------------------------------- sizes

_SIZE_UNITS: dict[str, int] = {
    "B": 1,
    "kB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
SIZE_FORMS = f"an int or a string like '512MiB', '4GiB', '1.5GB', '100kB' (units: {', '.join(_SIZE_UNITS)})"


def parse_size(value: Any) -> int:
    """Return ``value`` as a whole number of bytes: an int, or ``"<number><unit>"``.

    Units are ``B``, decimal ``kB MB GB TB`` and binary ``KiB MiB GiB TiB`` (case-sensitive, so
    the ambiguous ``KB``/``mb`` are refused).  Raises :class:`ConfigError` naming the accepted
    forms.
    """
    if isinstance(value, bool):
        raise ConfigError(f"expected {SIZE_FORMS} (got {value!r})")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    match = _SIZE_RE.match(value) if isinstance(value, str) else None
    if match is None or match.group(2) not in _SIZE_UNITS | {"": 1}:
        raise ConfigError(f"expected {SIZE_FORMS} (got {value!r})")
    try:
        number = Decimal(match.group(1)) * _SIZE_UNITS.get(match.group(2), 1)
    except InvalidOperation:  # pragma: no cover - the regex admits only decimal literals
        raise ConfigError(f"expected {SIZE_FORMS} (got {value!r})") from None
    if number != number.to_integral_value():
        raise ConfigError(f"{value!r} is not a whole number of bytes")
    return int(number)


def format_size(num_bytes: int) -> str:
    """``num_bytes`` exactly, in the largest unit dividing it (:func:`parse_size` inverts it)."""
    for unit, factor in sorted(_SIZE_UNITS.items(), key=lambda item: -item[1]):
        if num_bytes and factor > 1 and num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    return f"{num_bytes}B"


def _size_validator(value: Any) -> Any:
    try:
        return parse_size(value)
    except ConfigError as err:
        raise PydanticCustomError(CONFIG_ERROR_TYPE, "{message}", {"message": str(err)}) from None


Size = Annotated[int, BeforeValidator(_size_validator), Field(gt=0, le=2**50)]
"""A positive number of bytes up to 1 PiB, as an int or a size string (see :func:`parse_size`)."""


def _fail(message: str, field: str | None = None) -> PydanticCustomError:
    ctx: dict[str, Any] = {"message": message}
    if field is not None:
        ctx["field"] = field
    return PydanticCustomError(CONFIG_ERROR_TYPE, "{message}", ctx)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# -------------------------------------------------------------------------------------- cluster


def _matching(pattern: str, what: str) -> AfterValidator:
    compiled = re.compile(pattern)

    def check(value: str) -> str:
        if compiled.fullmatch(value) is None:
            raise _fail(f"must be {what} (got {value!r})")
        return value

    return AfterValidator(check)


Speed = Annotated[float, Field(gt=0, le=1)]  # relative to the fastest device (SPEC §8)
WorkerName = Annotated[str, _matching(r"[A-Za-z0-9_.-]{1,64}", "1-64 letters, digits, '_', '-' or '.'")]
HostName = Annotated[str, _matching(r"[A-Za-z0-9_.:-]{1,253}", "a host name or an IP address")]


class WorkerDefaults(_Model):
    """Values given to every worker entry that omits them."""

    speed: Speed = 1.0
    memory_bytes: Size = 8 * 2**30


class WorkerEntry(_Model):
    """One worker as written in the file; omitted fields come from ``cluster.defaults``."""

    name: WorkerName | None = None
    speed: Speed | None = None
    memory_bytes: Size | None = None


class WorkerSpec(_Model):
    """One worker with every field resolved (see :meth:`ClusterConfig.resolved_workers`)."""

    name: WorkerName
    speed: Speed
    memory_bytes: Size


class ClusterConfig(_Model):
    """The workers of a run: a list of entries, or ``num_workers`` copies of the defaults."""

    defaults: WorkerDefaults = WorkerDefaults()
    workers: tuple[WorkerEntry, ...] | None = Field(default=None, min_length=1)
    num_workers: int | None = Field(default=None, ge=1, le=4096)
    min_workers: int | None = Field(default=None, ge=1)
    host: HostName = "127.0.0.1"
    heartbeat_timeout_s: float = Field(default=10.0, gt=0, le=3600)  # silent worker declared dead

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if self.workers is None and self.num_workers is None:
            raise _fail("set one of workers, num_workers", "workers")
        if self.workers is not None and self.num_workers not in (None, len(self.workers)):
            raise _fail(
                f"must equal the length of workers ({len(self.workers)}) when both are set "
                f"(got {self.num_workers})",
                "num_workers",
            )
        total = self.effective_num_workers()
        if self.min_workers is not None and self.min_workers > total:
            raise _fail(f"must be <= the number of workers ({total}) (got {self.min_workers})", "min_workers")
        names = [worker.name for worker in self.resolved_workers()]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise _fail(f"duplicate worker names {duplicates} (unnamed entry i is 'w<i>')", "workers")
        return self

    def effective_num_workers(self) -> int:
        """The number of workers: ``len(workers)`` or ``num_workers``."""
        return len(self.workers) if self.workers is not None else int(self.num_workers or 0)

    def effective_min_workers(self) -> int:
        """How many workers must have joined before training starts (default: all of them)."""
        return self.min_workers if self.min_workers is not None else self.effective_num_workers()

    def resolved_workers(self) -> list[WorkerSpec]:
        """Every worker with defaults applied and names filled (``w{index}`` when omitted)."""
        entries = self.workers or (WorkerEntry(),) * self.effective_num_workers()
        return [
            WorkerSpec(
                name=entry.name if entry.name is not None else f"w{index}",
                speed=entry.speed if entry.speed is not None else self.defaults.speed,
                memory_bytes=(
                    entry.memory_bytes if entry.memory_bytes is not None else self.defaults.memory_bytes
                ),
            )
            for index, entry in enumerate(entries)
        ]


# ------------------------------------------------------------------------------------------ job


class ModelConfig(_Model):
    """Which model to train; ``width`` overrides its hidden size."""

    name: Literal["cnn1d", "mlp", "tiny_mlp", "char_transformer"]
    width: int | None = Field(default=None, gt=0, le=65536)


class DatasetConfig(_Model):
    """Which data set; ``synthetic`` is a generated linearly separable set for fast tests."""

    name: Literal["mnist1d", "synthetic", "pysource"]
    num_samples: int = Field(default=4000, ge=10, le=10**9)
    test_fraction: float = Field(default=0.2, gt=0, lt=1)

    @model_validator(mode="after")
    def _check(self) -> DatasetConfig:
        # The data layer owns the exact split; this only refuses an empty side.
        num_train = int(self.num_samples * (1.0 - self.test_fraction))
        if not 1 <= num_train < self.num_samples:
            raise _fail(
                f"leaves {num_train} of {self.num_samples} samples for training; "
                "train and test must both be non-empty",
                "test_fraction",
            )
        return self


class SGDOptimizer(_Model):
    """``torch.optim.SGD``."""

    kind: Literal["sgd"] = "sgd"
    lr: float = Field(default=0.05, gt=0)
    momentum: float = Field(default=0.9, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)
    nesterov: bool = False

    @model_validator(mode="after")
    def _check(self) -> SGDOptimizer:
        if self.nesterov and self.momentum == 0:
            raise _fail("needs momentum > 0 (got momentum=0)", "nesterov")
        return self


Beta = Annotated[float, Field(gt=0, lt=1)]


class AdamOptimizer(_Model):
    """``torch.optim.Adam``."""

    kind: Literal["adam"] = "adam"
    lr: float = Field(default=1e-3, gt=0)
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)


Optimizer = Annotated[Union[SGDOptimizer, AdamOptimizer], Field(discriminator="kind")]


class JobConfig(_Model):
    """What to train and for how long; ``batch_size`` is the GLOBAL batch of one step."""

    model: ModelConfig
    dataset: DatasetConfig
    optimizer: Optimizer = SGDOptimizer()
    batch_size: int = Field(default=128, ge=1, le=2**24)
    steps: int | None = Field(default=None, ge=1)
    epochs: int | None = Field(default=None, ge=1)
    seed: int = Field(default=0, ge=0, lt=2**63)
    eval_every_steps: int = Field(default=200, ge=0)

    @model_validator(mode="after")
    def _check(self) -> JobConfig:
        if (self.steps is None) == (self.epochs is None):
            got = "neither" if self.steps is None else f"steps={self.steps}, epochs={self.epochs}"
            raise _fail(f"exactly one of steps, epochs must be set (got {got}; set the other to null)")
        return self


# ------------------------------------------------------------------------------------- strategy


class AllReduceStrategy(_Model):
    """Synchronous data parallelism: bucketed all-reduce of gradients, atomic steps."""

    kind: Literal["allreduce"] = "allreduce"
    bucket_bytes: Size = 4 * 2**20
    step_timeout_s: float = Field(default=30.0, gt=0, le=86400)
    on_abort: Literal["redo", "drop"] = "redo"


class PSStrategy(_Model):
    """Data parallelism through a sharded parameter server (SPEC §1)."""

    kind: Literal["ps"] = "ps"
    consistency: Literal["bsp", "asp", "ssp", "wsp"] = "ssp"
    staleness: int = Field(default=3, ge=0, le=1000)  # SSP bound s
    s_local: int = Field(default=0, ge=0, le=64)  # WSP local staleness
    clock_distance: int = Field(default=0, ge=0, le=1000)  # WSP clock distance D
    num_servers: int = Field(default=2, ge=1, le=256)
    update: Literal["server_sgd", "delta"] = "server_sgd"  # who applies the optimizer
    chunk_bytes: Size = 4 * 2**20  # tensors above this are split
    pull_timeout_s: float = Field(default=60.0, gt=0, le=86400)
    cached_reads: bool = False  # SSP: skip pulls while the held weights are within the bound
    read_ahead: bool = False  # SSP (s >= 1) / ASP: pull the next clock's weights while computing
    snapshot_every_versions: int = Field(default=0, ge=0)  # 0 = never (by version count)
    snapshot_every_s: float = Field(default=0.0, ge=0)  # 0 = never (by time)

    @model_validator(mode="after")
    def _check(self) -> PSStrategy:
        if self.cached_reads and self.read_ahead:
            raise _fail(
                "excludes cached_reads: set at most one of the two to true (got both true)", "read_ahead"
            )
        return self


class PipelineStrategy(_Model):
    """Pipeline model parallelism (SPEC §3)."""

    kind: Literal["pipeline"] = "pipeline"
    schedule: Literal["gpipe", "1f1b", "pipedream"] = "1f1b"
    num_stages: int = Field(default=2, ge=1, le=64)
    num_microbatches: int = Field(default=8, ge=1, le=4096)
    vertical_sync: bool = False
    step_timeout_s: float = Field(default=60.0, gt=0, le=86400)


# Extend with new strategies by adding their models to this Union.
Strategy = Annotated[Union[AllReduceStrategy, PSStrategy, PipelineStrategy], Field(discriminator="kind")]


# --------------------------------------------------------------------------------------- report


class ReportConfig(_Model):
    """What the run reports and how often."""

    metrics_every_steps: int = Field(default=1, ge=1)
    digest_every_steps: int = Field(default=1, ge=0)  # parameter digest in the metrics; 0 = never


# ----------------------------------------------------------------------------------------- root


class RunConfig(_Model):
    """A whole run: ``cluster`` and ``job`` are required, ``strategy`` and ``report`` default."""

    cluster: ClusterConfig
    job: JobConfig
    strategy: Strategy = AllReduceStrategy()
    report: ReportConfig = ReportConfig()

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        num_workers = self.cluster.effective_num_workers()
        if self.job.batch_size < num_workers:
            raise _fail(
                f"must be >= the number of workers ({num_workers}) (got {self.job.batch_size})",
                "job.batch_size",
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of the whole configuration (sizes as ints, tuples as lists)."""
        return self.model_dump(mode="json")
