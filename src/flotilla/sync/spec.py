"""A strategy's registered spec: what the system knows of a strategy kind, declared in one value by
the strategy's own module (``sync/registry.py`` holds them).

A spec names:

- ``kind`` and a one-line ``summary`` (``flotilla strategies`` lists them);
- ``settings``: its settings model (a :class:`StrategySettings`, pydantic): the YAML
  ``strategy:`` section of this kind.  The section is validated against it (unknown fields refused,
  errors naming ``strategy.<field>`` and the allowed values), so a registered kind needs no edit in
  ``config/``;
- ``build(model, optimizer, settings, ctx) -> SyncStrategy``: a data-parallel worker's strategy
  (``None``: the kind has no data-parallel worker, e.g. ``pipeline``, whose stages run their own
  engine);
- ``check(settings, facts)``: what the settings need from the rest of the run (e.g. a group size
  below the number of workers), raising :class:`~flotilla.core.errors.ConfigError` naming the
  field -- called by ``flotilla validate`` and ``flotilla run`` alike;
- ``launch``: its :class:`~flotilla.cluster.launch_plan.LaunchNeeds` (servers, GPUs, where its
  durable state lives, whether it survives revocations);
- ``package(settings, job) -> config``: what ``build`` (and the strategy's servers) take, from
  the settings and the job (:class:`JobFacts`: e.g. ``ps``'s servers apply the job's optimizer);
  ``None``: the settings as they are;
- ``service(settings, facts) -> Service``: a service the coordinator hosts for the strategy (its
  message-plane handlers, told of dead workers; e.g. partial reduce's group controller);
- ``options(settings, facts)``: for a kind that runs other strategies (``adaptive``), the
  settings of the strategies its workers switch between, the one to start with first (the
  workers' strategy options; its service announces the switches);
- ``simulated``: the simulator's hook, an import path ``"package.module:function"`` of a
  function ``(settings) -> a simulated strategy`` (``flotilla.sim``: e.g.
  ``flotilla.sim.vote:allreduce_of``), named as a string because the simulator loads no torch
  and a strategy's module may; "": the kind is not simulated yet (``flotilla simulate`` says so);
- ``stages``: for a kind run by the pipeline runner, an import path of a function
  ``(settings) -> StagePlug`` (``sync/stage_plug.py``): what the strategy adds to every stage and
  to the launcher (e.g. ``hetpipe``: each pipeline instance a virtual worker syncing through
  parameter servers the launcher hosts); "": a plain pipeline.

A strategy's **state** (e.g. an outer optimizer's momentum) is the strategy instance's
``state_dict`` / ``load_state_dict`` (``sync/base.py``): sent to joiners with the model and
written to checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from pydantic import Field

from flotilla.cluster.launch_plan import LaunchNeeds
from flotilla.core.errors import ConfigError
from flotilla.core.settings import Settings

if TYPE_CHECKING:
    import torch
    from torch import nn

    from flotilla.ps.lr_schedule import LRSchedule
    from flotilla.sync.base import SyncStrategy

__all__ = [
    "JobFacts",
    "JobSnapshot",
    "PeerPlane",
    "RunFacts",
    "Service",
    "ServiceFacts",
    "SettingsError",
    "StrategyContext",
    "StrategySettings",
    "StrategySpec",
    "settings_error",
]


class StrategySettings(Settings):
    """Base of every strategy's settings model.  ``kind`` is the name the configuration used (a
    registered kind, or an import path such as ``./my_strategy.py:SPEC``): the registry sets it, so a
    settings model declares only its own fields."""

    kind: str = Field(default="", max_length=4096)

    # fields that arrange the same update differently (a pipeline's stage count): left out of the
    # checkpoint fingerprint, so a checkpoint resumes under other values (RunConfig.fingerprint)
    shape_fields: ClassVar[frozenset[str]] = frozenset()
    # fields that change nothing in the trained state (checks, reporting): left out of the
    # fingerprint too, so a checkpoint resumes whatever they say
    free_fields: ClassVar[frozenset[str]] = frozenset()

    def collective_timeout_s(self) -> float:
        """The bound on a view's collectives (a settings model with ``step_timeout_s`` returns it)."""
        return 30.0

    def abort_rule(self) -> str:
        """What a discarded unit does: ``redo`` it (exact-once data) or ``drop`` it."""
        return "redo"

    def servers_apply_optimizer(self) -> bool:
        """Whether the strategy's servers apply the job's optimizer and schedule (the workers'
        optimizer is then never stepped, and a task's own optimizer is refused)."""
        return False

    def launch_needs(self, declared: LaunchNeeds) -> LaunchNeeds:
        """What these settings need from the launcher: the spec's ``launch`` (``declared``), or
        a variant of it where a setting changes it (hetpipe's ``reform`` takes revocations)."""
        return declared


class VotedSettings(StrategySettings):
    """Settings of a strategy whose members vote on every commit unit (``allreduce``, ``diloco``):
    the bound on a view's collectives and what a discarded unit does."""

    step_timeout_s: float = Field(default=30.0, gt=0, le=86400)
    on_abort: Literal["redo", "drop"] = "redo"  # redo the discarded unit, or drop its samples

    def collective_timeout_s(self) -> float:
        return self.step_timeout_s

    def abort_rule(self) -> str:
        return self.on_abort


class SettingsError(ConfigError):
    """A spec's ``check`` refused its settings: ``field`` (a field of the strategy section, or a
    dotted path from the run's root when it starts with a section name) and why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"strategy.{field}: {message}" if "." not in field else f"{field}: {message}")
        self.field, self.message = field, message


def settings_error(field: str, message: str) -> SettingsError:
    return SettingsError(field, message)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunFacts:
    """What a spec's ``check`` may look at besides its own settings (pure data)."""

    num_workers: int
    batch_size: int
    optimizer_kind: str = ""
    speeds: tuple[float, ...] = ()  # the configured workers' speeds (1.0: the host's)


class PeerPlane(Protocol):
    """What a strategy may do with its peers directly (a decentralised strategy: ``adpsgd``), over
    the message plane (authenticated frames, tensors without pickle):

    - ``register(op, handler, schema, max_tensors=)``: answer ``op`` on this worker's peer server
      (its serving thread; a handler takes a ``comm.endpoint.Request`` and returns a dict or a
      ``comm.endpoint.Reply``).  Registering an op again replaces its handler (a strategy built
      again after a switch); ``unregister(op)`` makes the server refuse it (``unavailable``).
    - ``address_of(worker_id)``: a member's peer server as the coordinator announced it (None:
      not known);
    - ``connect(address)``: a client (``call(op, body, tensors, timeout_s=)``, ``close()``)."""

    def register(self, op: str, handler: Callable[[Any], Any], schema: dict[str, Any] | None = None,
                 *, max_tensors: int | None = None) -> None: ...  # fmt: skip

    def unregister(self, op: str) -> None: ...

    def address_of(self, worker_id: int) -> str | None: ...

    def connect(self, address: str) -> Any: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class StrategyContext:
    """What ``build`` may use besides the model, optimizer and settings.  ``rank``/``num_workers``
    are those of the view the strategy starts in; ``servers``/``secret`` reach PS shards."""

    worker_id: int
    rank: int
    num_workers: int
    secret: bytes = b""
    servers: tuple[str, ...] = ()
    on_bucket_ready: Callable[[int], None] | None = None
    # groups formed while running (GroupNeed.PER_STEP): ``groups().get(namespace, members, me)``
    # (``comm.group_factory.GroupFactory``); ``members``/``epoch``: the view the strategy starts in
    groups: Callable[[], Any] | None = None
    members: tuple[int, ...] = ()
    epoch: int = 0
    # the coordinator's message plane (``call(op, body, timeout_s) -> dict``): partial reduce's controller
    coordinator: Any = None
    # worker ids the coordinator declared dead or gone (``ps``: evicted from the shards' clocks)
    gone: Callable[[], frozenset[int]] | None = None
    # this worker's peer plane (:class:`PeerPlane`): ops on its peer server, the members' addresses
    peers: PeerPlane | None = None
    # this worker joined the running job and holds no state yet (a strategy without a view's state
    # agreement fetches it itself: ``adpsgd`` from a live peer)
    joined: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class JobFacts:
    """What ``package`` may use besides the settings: the job's optimizer settings
    (``job.optimizer``: ``kind``, ``lr``, ``momentum``, ...) and its learning-rate schedule
    (``schedule()``: the pure ``ps.lr_schedule`` one; it raises ``ConfigError`` where the job's
    length is needed and unknown)."""

    optimizer: Any
    schedule: Callable[[], LRSchedule]


@dataclass(frozen=True, kw_only=True, slots=True)
class ServiceFacts:
    """What ``service`` may use: the job's number of workers, the coordinator's clock and
    whether the job is stopping; the configured speeds; ``snapshot()``: the job's progress now
    (:class:`JobSnapshot`); ``announce(option)``: announce a switch to strategy option ``option``
    (>= 1) at a step every live worker reaches later, returned (raises ``ValueError`` when no step
    is left) -- a policy that switches strategies at run time (``adaptive``) uses the last two."""

    num_workers: int
    now: Callable[[], float]
    stopped: Callable[[], bool]
    speeds: tuple[float, ...] = ()
    snapshot: Callable[[], JobSnapshot] | None = None
    announce: Callable[[int], int] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSnapshot:
    """The job's progress as the coordinator knows it (pure data): the live workers, each one's
    last reported step and its own time per step (compute, emulated slowness included: the
    device's pace, not the barrier's), and when workers were lost (seconds on ``now_s``'s clock)."""

    now_s: float
    live: tuple[int, ...]
    steps: dict[int, int]
    compute_s: dict[int, float]
    lost_at_s: tuple[float, ...] = ()


Handler = Callable[[Any], dict[str, Any]]


class Service(Protocol):
    """A strategy's service on the coordinator."""

    def handlers(self) -> dict[str, tuple[Handler, dict[str, Any]]]:
        """op -> (handler, body schema), added to the coordinator's message plane."""
        ...

    def on_dead(self, worker_id: int) -> None:
        """The coordinator declared ``worker_id`` dead -- or it had finished its steps and its
        process died before the job's end (what it still served died with it)."""
        ...

    def stats(self) -> dict[str, Any] | None:
        """Counts for the coordinator's status (under the strategy's kind)."""
        ...


Builder = Callable[["nn.Module", "torch.optim.Optimizer", Any, StrategyContext], "SyncStrategy"]
Options = Callable[[Any, RunFacts], "tuple[StrategySettings, ...]"]
Check = Callable[[Any, RunFacts], None]
Package = Callable[[Any, JobFacts], Any]
ServiceMaker = Callable[[Any, ServiceFacts], Service]


def _no_check(settings: Any, facts: RunFacts) -> None:
    return None


@dataclass(frozen=True, kw_only=True)
class StrategySpec:
    """One strategy kind (see the module doc)."""

    kind: str
    settings: type[StrategySettings] = StrategySettings
    build: Builder | None = None
    summary: str = ""
    check: Check = _no_check
    launch: LaunchNeeds = field(default_factory=LaunchNeeds)
    package: Package | None = None
    service: ServiceMaker | None = None
    # a kind that runs other strategies (``adaptive``): the settings of the strategies the workers
    # switch between, option 0 (the one to start with) first; None: the kind is one strategy
    options: Options | None = None
    simulated: str = ""  # "package.module:function": settings -> flotilla.sim strategy (module doc)
    stages: str = ""  # "package.module:function": settings -> sync.stage_plug.StagePlug (module doc)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind.isidentifier():
            raise TypeError(f"StrategySpec.kind must be an identifier, got {self.kind!r}")
        if not (isinstance(self.settings, type) and issubclass(self.settings, StrategySettings)):
            raise TypeError(
                f"StrategySpec {self.kind!r}: settings must be a StrategySettings subclass, "
                f"got {self.settings!r}"
            )
        if self.build is not None and not callable(self.build):
            raise TypeError(f"StrategySpec {self.kind!r}: build must be callable, got {self.build!r}")
        if not isinstance(self.simulated, str) or (self.simulated and ":" not in self.simulated):
            raise TypeError(
                f"StrategySpec {self.kind!r}: simulated must be 'package.module:function' or '', "
                f"got {self.simulated!r}"
            )
        if not isinstance(self.stages, str) or (self.stages and ":" not in self.stages):
            raise TypeError(
                f"StrategySpec {self.kind!r}: stages must be 'package.module:function' or '', "
                f"got {self.stages!r}"
            )
        for part in ("check", "package", "service", "options"):
            value = getattr(self, part)
            if value is not None and not callable(value):
                raise TypeError(f"StrategySpec {self.kind!r}: {part} must be callable, got {value!r}")

    def config(self, settings: Any, job: JobFacts) -> Any:
        """What ``build`` takes for ``settings`` (``package``, else the settings as they are)."""
        return self.package(settings, job) if self.package is not None else settings

    def fields(self) -> dict[str, str]:
        """The settings' fields (but ``kind``) and their defaults, as text (``flotilla strategies``)."""
        out: dict[str, str] = {}
        for name, info in self.settings.model_fields.items():
            if name == "kind":
                continue
            out[name] = "required" if info.is_required() else repr(info.default)
        return out
