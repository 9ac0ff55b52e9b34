"""Package configuration of the parameter server: everything the PS runtime (servers, client,
``sync/via_ps``) needs, as frozen dataclasses validated on construction.  Pure: no torch, no
pydantic, no I/O.  The run configuration (``flotilla.config``) is converted to it by
``flotilla.sync.ps_settings.ps_config_from(strategy, optimizer)`` (the ``ps`` spec's
``package``); runtime modules take these types, never pydantic models.

- :class:`PSConfig`: one job's PS rules: the tagged consistency model (``BSP()``, ``ASP()``,
  ``SSP(staleness)``, ``WSP(s_local, clock_distance)``), the update rule (``ServerSGD(...)`` or
  ``DeltaUpdate()``), ``num_servers``, ``chunk_bytes``, ``pull_timeout_s``, the read mode and the
  snapshot triggers.
- :class:`ShardConfig`: one shard's identity and rules (:func:`shard_config_from`).
- :class:`ClientOptions`: a worker's call timeouts (``ClientOptions.of(ps)``).

Invariants (checked here, errors name the field and the allowed values):
- WSP with ``s_local > 0`` pushes one aggregated update per wave, so it needs ``DeltaUpdate``;
- ``read_mode`` is one of :data:`READ_MODES`; ``"cached"`` acts only under SSP and
  ``"read_ahead"`` only where :func:`~flotilla.ps.consistency.max_pull_ahead` allows it (elsewhere
  they are accepted and have no effect, see :attr:`PSConfig.cached_reads` / ``read_ahead``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from flotilla.core.checks import require_choice, require_instance, require_int, require_number
from flotilla.core.errors import ConfigError
from flotilla.ps.consistency import ASP, BSP, SSP, WSP, ConsistencyModel, max_pull_ahead, wave_size_of
from flotilla.ps.lr_schedule import Constant, Cosine, LinearWarmup, LRSchedule
from flotilla.ps.sharding import DEFAULT_CHUNK_BYTES

__all__ = [
    "READ_MODES",
    "ClientOptions",
    "DeltaUpdate",
    "PSConfig",
    "ReadMode",
    "ServerSGD",
    "ShardConfig",
    "UpdateRule",
    "shard_config_from",
]

ReadMode = Literal["plain", "cached", "read_ahead"]
"""``plain``: pull every clock; ``cached``: SSP's client cache (skip pulls while the held weights
are within the bound); ``read_ahead``: pull the next clock's weights while computing."""
READ_MODES: Final[tuple[ReadMode, ...]] = ("plain", "cached", "read_ahead")


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerSGD:
    """Server-side SGD (torch.optim.SGD semantics, dampening 0), one step per global clock on the
    sum ``g`` of that clock's pushes: ``g += wd*w; m = mu*m + g; w -= lr*(g + mu*m if nesterov
    else m)``, applied incrementally as ``ps/store.py`` describes.  The step of clock c uses
    ``lr_at(c) = lr * schedule.factor(c)`` (``ps/lr_schedule.py``; constant by default), as
    ``torch.optim.SGD`` with a ``LambdaLR`` stepped once per step would."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    schedule: LRSchedule = Constant()

    def __post_init__(self) -> None:
        require_number("ServerSGD", "lr", self.lr, gt=0.0)
        require_instance("ServerSGD", "schedule", self.schedule, (Constant, LinearWarmup, Cosine))
        require_number("ServerSGD", "momentum", self.momentum, min=0.0)
        require_number("ServerSGD", "weight_decay", self.weight_decay, min=0.0)
        if self.momentum >= 1:
            raise ConfigError(f"ServerSGD.momentum must be in [0, 1), got {self.momentum!r}")
        if self.nesterov and self.momentum == 0:
            raise ConfigError("ServerSGD.nesterov needs momentum > 0")

    @property
    def gradient_gain(self) -> float:
        """Factor of a push's immediate gradient step (``1 + mu`` with Nesterov)."""
        return 1.0 + self.momentum if self.nesterov else 1.0

    @property
    def momentum_lr(self) -> float:
        """Step size of the momentum buffer (``lr·mu``, ``lr·mu²`` with Nesterov)."""
        return self.lr * (self.momentum**2 if self.nesterov else self.momentum)

    def lr_at(self, clock: int) -> float:
        """The learning rate of global clock ``clock`` (exactly ``lr`` under a constant schedule)."""
        if isinstance(self.schedule, Constant):
            return self.lr
        return self.lr * self.schedule.factor(clock)

    def scale_at(self, clock: int) -> float:
        """``lr_at(clock) / lr``: how much every step size of clock ``clock`` is scaled."""
        return 1.0 if isinstance(self.schedule, Constant) else self.schedule.factor(clock)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeltaUpdate:
    """Workers apply their optimizer locally and push deltas; the server adds them: ``w += u``.

    The rule that makes one clock worth one step of the global batch (``sync/via_ps.py``): with
    N = the job's workers, a worker steps its optimizer on ``N·g`` (g: its gradient of the loss
    scaled by ``1/global_batch``, so ``N·g`` is its local mean gradient when the batch splits
    evenly) and pushes ``u = (w_after - w_pulled) / N``.  A clock thus moves the global weights by
    the MEAN of the workers' updates; with SGD (momentum, weight decay, Nesterov: all linear in
    the gradient) under BSP that is exactly ``torch.optim.SGD``'s step on the global-batch mean
    gradient, as under ``allreduce``; with Adam/AdamW every worker's step has about the size
    of one step, and so has their mean.  N is ``PSSync``'s ``num_workers`` (the PS membership
    is fixed; every worker pushes every clock)."""


UpdateRule = ServerSGD | DeltaUpdate
_CONSISTENCY_TYPES = (BSP, ASP, SSP, WSP)


def _check_rules(owner: str, consistency: object, update: object) -> None:
    require_instance(owner, "consistency", consistency, _CONSISTENCY_TYPES)
    require_instance(owner, "update", update, (ServerSGD, DeltaUpdate))
    if isinstance(consistency, WSP) and consistency.s_local > 0 and not isinstance(update, DeltaUpdate):
        raise ConfigError(
            f"{owner}.update must be DeltaUpdate ('delta') when consistency is WSP with "
            f"s_local > 0 (got ServerSGD ('server_sgd'), s_local={consistency.s_local})"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class PSConfig:
    """The parameter-server rules of one job (see the module doc)."""

    consistency: ConsistencyModel = SSP(staleness=3)
    update: UpdateRule
    num_servers: int = 2
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    pull_timeout_s: float = 60.0
    read_mode: ReadMode = "plain"
    snapshot_every_versions: int = 0  # 0 = never (by version count)
    snapshot_every_s: float = 0.0  # 0 = never (by time)

    def __post_init__(self) -> None:
        _check_rules("PSConfig", self.consistency, self.update)
        require_int("PSConfig", "num_servers", self.num_servers, min=1)
        require_int("PSConfig", "chunk_bytes", self.chunk_bytes, min=1)
        require_number("PSConfig", "pull_timeout_s", self.pull_timeout_s, gt=0.0)
        require_choice("PSConfig", "read_mode", self.read_mode, READ_MODES)
        require_int("PSConfig", "snapshot_every_versions", self.snapshot_every_versions, min=0)
        require_number("PSConfig", "snapshot_every_s", self.snapshot_every_s, min=0.0)

    @property
    def wave_size(self) -> int:
        """Minibatches per push: ``s_local + 1`` under WSP, else 1."""
        return wave_size_of(self.consistency)

    @property
    def effective_read_mode(self) -> ReadMode:
        """The read mode in effect: ``cached`` under SSP only, ``read_ahead`` only where the
        consistency model allows a pull ahead; otherwise ``plain``."""
        if self.read_mode == "cached" and isinstance(self.consistency, SSP):
            return "cached"
        if self.read_mode == "read_ahead" and max_pull_ahead(self.consistency) > 0:
            return "read_ahead"
        return "plain"

    @property
    def cached_reads(self) -> bool:
        """Whether SSP's client cache is on."""
        return self.effective_read_mode == "cached"

    @property
    def read_ahead(self) -> bool:
        """Whether read-ahead is on (asked for, and allowed by the consistency model)."""
        return self.effective_read_mode == "read_ahead"


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardConfig:
    """Identity and rules of one shard.  ``num_workers`` workers are expected to join."""

    shard_index: int
    num_shards: int
    num_workers: int
    consistency: ConsistencyModel
    update: UpdateRule
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    data_key: str = ""  # which samples a clock draws (RunConfig.data_fingerprint; in its snapshots)

    def __post_init__(self) -> None:
        for name in ("num_shards", "num_workers", "chunk_bytes"):
            require_int("ShardConfig", name, getattr(self, name), min=1)
        require_int("ShardConfig", "shard_index", self.shard_index, min=0, max=self.num_shards - 1)
        _check_rules("ShardConfig", self.consistency, self.update)


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientOptions:
    """A worker's PS calls: ``pull_timeout_s``: how long any call may take in all (a gated pull
    included); ``attempt_timeout_s``: one attempt (and a pull's server-side wait) before retrying."""

    pull_timeout_s: float = 60.0
    attempt_timeout_s: float = 5.0
    retry_pause_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("pull_timeout_s", "attempt_timeout_s", "retry_pause_s"):
            require_number("ClientOptions", name, getattr(self, name), gt=0.0)

    @classmethod
    def of(cls, ps: PSConfig) -> ClientOptions:
        """The options of a job's :class:`PSConfig`: its ``pull_timeout_s``, attempts of at most 5 s."""
        return cls(pull_timeout_s=ps.pull_timeout_s, attempt_timeout_s=min(5.0, ps.pull_timeout_s))


def shard_config_from(ps: PSConfig, *, num_workers: int, shard_index: int, data_key: str = "") -> ShardConfig:
    """The :class:`ShardConfig` of shard ``shard_index`` of a job's :class:`PSConfig`
    (``data_key``: the job's ``RunConfig.data_fingerprint()``)."""
    return ShardConfig(
        shard_index=shard_index,
        num_shards=ps.num_servers,
        num_workers=num_workers,
        consistency=ps.consistency,
        update=ps.update,
        chunk_bytes=ps.chunk_bytes,
        data_key=data_key,
    )
