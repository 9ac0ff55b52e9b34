"""Pipeline schedule IR and its generators (SPEC §3.3): pure data, no torch, no clock.

A ``Schedule`` gives every stage the ordered tuple of ``Action``s it executes.  The stage runtime
runs that list; the simulator (``validate.dry_run`` / ``modelled_timeline``) replays the same list
with modelled times.  Conventions:

- **Indices.** ``microbatch_idx`` is global: microbatch b belongs to minibatch
  ``b // num_microbatches``.  PipeDream's asynchronous schedule has ``num_microbatches == 1``, so
  there ``microbatch_idx`` IS the minibatch index.
- **Communication.** ``SendAct(b, i+1)`` / ``RecvAct(b, i-1)`` carry the activations of b forward,
  ``SendGrad(b, i-1)`` / ``RecvGrad(b, i+1)`` the gradients backward.  Sends never block (the runtime
  uses asynchronous sends); receives block until the matching send was issued.  Messages are
  matched by (direction, microbatch, src, dst) and each channel is FIFO (needed by NCCL).
- **Weight versions.** Every stage starts at version 0; ``OptimizerStep(reads_version=v,
  writes_version=v+1)`` applies the accumulated gradients to the newest weights v and makes v+1 the
  newest.  ``Forward(b, v)`` runs b with version v and ``Backward(b, v)`` MUST use the same v.
  There are no explicit stash actions: a stage keeps version v alive while any later action names
  it (weight stashing), and drops it once the last such action ran and v is no longer the newest.
  In flush schedules every pass of minibatch k uses version k.  In PipeDream without vertical sync
  a forward uses the stage's newest version; with vertical sync every stage uses, for b, the
  version stage 0 used for b (the tag b carried in).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Union

from flotilla.core.errors import ConfigError


class ScheduleKind(StrEnum):
    """Which family a schedule belongs to (decides the validator's semantic checks)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    PIPEDREAM = "pipedream"

    @property
    def flushes(self) -> bool:
        """True for the synchronous schedules (one optimizer step per minibatch after a flush)."""
        return self is not ScheduleKind.PIPEDREAM


@dataclass(frozen=True, slots=True)
class Forward:
    microbatch_idx: int
    weight_version: int


@dataclass(frozen=True, slots=True)
class Backward:
    microbatch_idx: int
    weight_version: int


@dataclass(frozen=True, slots=True)
class SendAct:
    microbatch_idx: int
    peer_stage: int


@dataclass(frozen=True, slots=True)
class RecvAct:
    microbatch_idx: int
    peer_stage: int


@dataclass(frozen=True, slots=True)
class SendGrad:
    microbatch_idx: int
    peer_stage: int


@dataclass(frozen=True, slots=True)
class RecvGrad:
    microbatch_idx: int
    peer_stage: int


@dataclass(frozen=True, slots=True)
class OptimizerStep:
    reads_version: int
    writes_version: int


Action = Union[Forward, Backward, SendAct, RecvAct, SendGrad, RecvGrad, OptimizerStep]
COMPUTE_ACTIONS = (Forward, Backward, OptimizerStep)
SEND_ACTIONS = (SendAct, SendGrad)
RECV_ACTIONS = (RecvAct, RecvGrad)

_PASS_TAGS = {Forward: "F", Backward: "B"}
_COMM_TAGS: dict[type[SendAct | RecvAct | SendGrad | RecvGrad], tuple[str, str]] = {
    SendAct: ("SA", ">"),
    RecvAct: ("RA", "<"),
    SendGrad: ("SG", ">"),
    RecvGrad: ("RG", "<"),
}
_PASS_RE = re.compile(r"^([FB])(\d+)@v(\d+)$")
_COMM_RE = re.compile(r"^(SA|RA|SG|RG)(\d+)([<>])(\d+)$")
_OPT_RE = re.compile(r"^OPT(\d+)>(\d+)$")


def format_action(action: Action) -> str:
    """Compact text form used in golden files: ``F3@v1``, ``SA3>1``, ``RG3<2``, ``OPT1>2``."""
    if isinstance(action, (Forward, Backward)):
        return f"{_PASS_TAGS[type(action)]}{action.microbatch_idx}@v{action.weight_version}"
    if isinstance(action, OptimizerStep):
        return f"OPT{action.reads_version}>{action.writes_version}"
    tag, arrow = _COMM_TAGS[type(action)]
    return f"{tag}{action.microbatch_idx}{arrow}{action.peer_stage}"


def parse_action(text: str) -> Action:
    """Inverse of ``format_action``; raises ``ConfigError`` on anything else."""
    if m := _PASS_RE.match(text):
        if m[1] == "F":
            return Forward(int(m[2]), int(m[3]))
        return Backward(int(m[2]), int(m[3]))
    if m := _OPT_RE.match(text):
        return OptimizerStep(int(m[1]), int(m[2]))
    if m := _COMM_RE.match(text):
        for cls, (tag, arrow) in _COMM_TAGS.items():
            if tag == m[1] and arrow == m[3]:
                return cls(int(m[2]), int(m[4]))
    raise ConfigError(f"not a schedule action: {text!r} (expected e.g. 'F3@v0', 'SA3>1', 'RG3<2', 'OPT0>1')")


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """Per-stage action lists plus the parameters they were generated for (structure checked here,
    semantics by ``flotilla.pipeline.validate.validate``)."""

    kind: ScheduleKind
    num_stages: int
    num_microbatches: int
    num_minibatches: int
    vertical_sync: bool
    stages: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ScheduleKind):
            raise ConfigError(
                f"Schedule.kind must be one of {[k.value for k in ScheduleKind]}, got {self.kind!r}"
            )
        for name in ("num_stages", "num_microbatches", "num_minibatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"Schedule.{name} must be an integer >= 1, got {value!r}")
        if self.kind is ScheduleKind.PIPEDREAM and self.num_microbatches != 1:
            raise ConfigError("Schedule.num_microbatches must be 1 for kind 'pipedream'")
        if self.vertical_sync and self.kind is not ScheduleKind.PIPEDREAM:
            raise ConfigError("Schedule.vertical_sync is only allowed for kind 'pipedream'")
        if len(self.stages) != self.num_stages:
            raise ConfigError(
                f"Schedule.stages has {len(self.stages)} entries, num_stages is {self.num_stages}"
            )

    @property
    def total_microbatches(self) -> int:
        return self.num_microbatches * self.num_minibatches

    def minibatch_of(self, microbatch_idx: int) -> int:
        return microbatch_idx // self.num_microbatches

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "num_minibatches": self.num_minibatches,
            "vertical_sync": self.vertical_sync,
            "stages": [[format_action(a) for a in stage] for stage in self.stages],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schedule:
        try:
            kind = ScheduleKind(data["kind"])
            stages = tuple(tuple(parse_action(text) for text in stage) for stage in data["stages"])
            return cls(
                kind=kind,
                num_stages=data["num_stages"],
                num_microbatches=data["num_microbatches"],
                num_minibatches=data["num_minibatches"],
                vertical_sync=data["vertical_sync"],
                stages=stages,
            )
        except KeyError as exc:
            raise ConfigError(f"schedule is missing field {exc}") from exc
        except ValueError as exc:
            raise ConfigError(f"schedule: {exc}") from exc


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


def _forward(stage: int, p: int, b: int, version: int) -> list[Action]:
    """Receive b's input (not on stage 0), run the forward, send the output (not on the last)."""
    out: list[Action] = [RecvAct(b, stage - 1)] if stage > 0 else []
    out.append(Forward(b, version))
    if stage < p - 1:
        out.append(SendAct(b, stage + 1))
    return out


def _backward(stage: int, p: int, b: int, version: int) -> list[Action]:
    """Receive b's output gradient (not on the last stage), run the backward, send it upstream."""
    out: list[Action] = [RecvGrad(b, stage + 1)] if stage < p - 1 else []
    out.append(Backward(b, version))
    if stage > 0:
        out.append(SendGrad(b, stage - 1))
    return out


def gpipe(num_stages: int, num_microbatches: int, num_minibatches: int = 1) -> Schedule:
    """GPipe: per minibatch k, all m forwards, then all m backwards in reverse microbatch order (as
    in the GPipe paper), then one synchronous ``OptimizerStep(k, k+1)`` on every stage (flush).
    Peak in-flight activations per stage: m."""
    _check_counts(num_stages=num_stages, num_microbatches=num_microbatches, num_minibatches=num_minibatches)
    p, m = num_stages, num_microbatches
    stages = []
    for i in range(p):
        actions: list[Action] = []
        for k in range(num_minibatches):
            mbs = range(k * m, (k + 1) * m)
            for b in mbs:
                actions += _forward(i, p, b, k)
            for b in reversed(mbs):
                actions += _backward(i, p, b, k)
            actions.append(OptimizerStep(k, k + 1))
        stages.append(tuple(actions))
    return Schedule(
        kind=ScheduleKind.GPIPE,
        num_stages=p,
        num_microbatches=m,
        num_minibatches=num_minibatches,
        vertical_sync=False,
        stages=tuple(stages),
    )


def one_f_one_b(num_stages: int, num_microbatches: int, num_minibatches: int = 1) -> Schedule:
    """PipeDream-Flush / DAPPLE 1F1B: per minibatch, stage i runs min(p-i-1, m) warm-up forwards,
    then alternates one forward and one backward, then the cool-down backwards, then the flush and
    one synchronous update.  Peak in-flight activations on stage i: min(p-i, m)."""
    _check_counts(num_stages=num_stages, num_microbatches=num_microbatches, num_minibatches=num_minibatches)
    p, m = num_stages, num_microbatches
    stages = []
    for i in range(p):
        actions: list[Action] = []
        for k in range(num_minibatches):
            first = k * m
            warmup = min(p - i - 1, m)
            for b in range(first, first + warmup):
                actions += _forward(i, p, b, k)
            for step in range(m - warmup):
                actions += _forward(i, p, first + warmup + step, k)
                actions += _backward(i, p, first + step, k)
            for b in range(first + m - warmup, first + m):
                actions += _backward(i, p, b, k)
            actions.append(OptimizerStep(k, k + 1))
        stages.append(tuple(actions))
    return Schedule(
        kind=ScheduleKind.ONE_F_ONE_B,
        num_stages=p,
        num_microbatches=m,
        num_minibatches=num_minibatches,
        vertical_sync=False,
        stages=tuple(stages),
    )


def pipedream(
    num_stages: int, num_minibatches: int, vertical_sync: bool = False, in_flight: int | None = None
) -> Schedule:
    """PipeDream asynchronous 1F1B (no flush): stage i runs min(w_i, n) warm-up forwards, then
    alternates backward+update and forward, then drains.  An ``OptimizerStep`` follows every
    backward.  Weight stashing: each backward names the version its forward used.  With
    ``vertical_sync`` every stage uses, for minibatch b, the version stage 0 tagged b with.

    Stage i keeps w_i = max(1, N - i) minibatches in flight, N = ``in_flight`` (default: the
    number of stages, PipeDream's choice: the pipeline just full).  So stage 0's forward of
    minibatch b runs on its updates of minibatches 0 … b - N (HetPipe's local staleness
    s_local = N - 1, SPEC §2); with N < the number of stages the pipeline is not full.  The
    warm-ups never grow along the pipeline, so no stage waits for a forward it has not sent."""
    _check_counts(num_stages=num_stages, num_minibatches=num_minibatches)
    p, n = num_stages, num_minibatches
    depth = p if in_flight is None else in_flight
    if not isinstance(depth, int) or depth < 1:
        raise ConfigError(f"in_flight must be an int >= 1, got {in_flight!r}")
    tags: dict[int, int] = {}  # minibatch -> version stage 0 ran its forward with
    stages = tuple(_pipedream_stage(i, p, max(1, depth - i), n, tags, vertical_sync) for i in range(p))
    return Schedule(
        kind=ScheduleKind.PIPEDREAM,
        num_stages=p,
        num_microbatches=1,
        num_minibatches=n,
        vertical_sync=vertical_sync,
        stages=stages,
    )


def pipedream_warmup(num_stages: int, stage: int, in_flight: int | None = None) -> int:
    """Minibatches stage ``stage`` keeps in flight under :func:`pipedream` (before the drain)."""
    return max(1, (num_stages if in_flight is None else in_flight) - stage)


def _pipedream_stage(
    i: int, p: int, depth: int, n: int, tags: dict[int, int], vertical_sync: bool
) -> tuple[Action, ...]:
    """Actions of stage i of p keeping ``depth`` minibatches in flight; stage 0 must be generated
    first (it fills ``tags``)."""
    actions: list[Action] = []
    forward_version: dict[int, int] = {}
    newest = 0

    def run_forward(b: int) -> None:
        if i == 0:
            tags[b] = newest
        version = tags[b] if vertical_sync else newest
        if version > newest:  # impossible: stage i applied b' < b's updates before stage 0 did
            raise AssertionError(f"stage {i} lacks version {version} for minibatch {b}")
        forward_version[b] = version
        actions.extend(_forward(i, p, b, version))

    warmup = min(depth, n)
    for b in range(warmup):
        run_forward(b)
    for b in range(n):
        actions.extend(_backward(i, p, b, forward_version[b]))
        actions.append(OptimizerStep(newest, newest + 1))
        newest += 1
        if b + warmup < n:
            run_forward(b + warmup)
    return tuple(actions)


def make_schedule(
    kind: ScheduleKind,
    num_stages: int,
    num_microbatches: int,
    num_minibatches: int = 1,
    vertical_sync: bool = False,
    in_flight: int | None = None,
) -> Schedule:
    """Dispatch to the generator of ``kind`` (for PipeDream ``num_microbatches`` must be 1, the
    number of minibatches is ``num_minibatches`` and ``in_flight`` its depth: :func:`pipedream`)."""
    if kind is ScheduleKind.GPIPE:
        return gpipe(num_stages, num_microbatches, num_minibatches)
    if kind is ScheduleKind.ONE_F_ONE_B:
        return one_f_one_b(num_stages, num_microbatches, num_minibatches)
    if num_microbatches != 1:
        raise ConfigError("num_microbatches must be 1 for kind 'pipedream' (each minibatch is one unit)")
    return pipedream(num_stages, num_minibatches, vertical_sync, in_flight)
