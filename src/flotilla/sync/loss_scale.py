"""The dynamic loss scale of ``job.precision: fp16`` as a pure rule (no torch; the runtime that
scales, unscales and checks gradients is ``sync/scaler.py``).

The loss is multiplied by the scale ``S`` before backward, so small float16 gradients do not
flush to zero; the gradients are multiplied by ``1/S`` before anything reads them for an update.
After every unit the scale moves by torch's ``GradScaler`` rule, as a function of the unit's
AGREED verdict only (:class:`Verdict`: the barrier's vote, a pipeline's MAX verdict, or a worker
on its own its own check), so every member that saw the same verdicts holds the same scale:

- ``GOOD`` (the unit committed): one more good unit; after ``growth_interval`` of them in a row
  the scale is multiplied by ``growth_factor`` and the count restarts;
- ``OVERFLOW`` (the loss was finite, a scaled gradient was not: the unit was skipped): the scale
  is multiplied by ``backoff_factor`` (never below ``min_scale``) and the count restarts;
- ``OTHER`` (discarded for another reason: a broken group, a fault, a non-finite loss): no
  change -- nothing was learnt about the scale.

Every factor is a power of two by default, so scaling and unscaling are exact (in float32's
normal range) and the scale itself stays exactly representable.

Pipeline stages agree on a verdict at every flush (``trainer/stage_verdict.py``): the flushing
schedules (:data:`FP16_SCHEDULES`) take fp16; PipeDream's schedule (``pipeline`` with
``schedule: pipedream``, ``hetpipe``'s stages) has no flush at which the stages could skip an
overflowed step together, so the configuration refuses it (:func:`stage_fp16_refusal`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum

__all__ = [
    "FP16_KINDS",
    "FP16_SCHEDULES",
    "ScaleRule",
    "ScaleState",
    "Verdict",
    "next_scale",
    "stage_fp16_refusal",
]

# the strategies whose replicas train under fp16, and the pipeline schedules whose stages do (a
# flush per step: module doc)
FP16_KINDS = ("allreduce", "diloco", "ps", "partial_reduce", "adpsgd", "adaptive")
FP16_SCHEDULES = ("gpipe", "1f1b")


class Verdict(Enum):
    """What the members agreed about one unit, as the scale sees it (module doc)."""

    GOOD = "good"
    OVERFLOW = "overflow"
    OTHER = "other"


@dataclass(frozen=True, kw_only=True, slots=True)
class ScaleRule:
    """``torch.amp.GradScaler``'s defaults: start at 2**16, double after 2000 good units in a
    row, halve at an overflow."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 2.0**-24  # (float16's smallest subnormal: a scale below it means nothing)

    def __post_init__(self) -> None:
        for name in ("init_scale", "growth_factor", "min_scale"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"ScaleRule.{name} must be a finite number > 0, got {value!r}")
        if self.growth_factor < 1.0:
            raise ValueError(f"ScaleRule.growth_factor must be >= 1, got {self.growth_factor!r}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"ScaleRule.backoff_factor must be in (0, 1), got {self.backoff_factor!r}")
        if self.growth_interval < 1:
            raise ValueError(f"ScaleRule.growth_interval must be >= 1, got {self.growth_interval!r}")

    def initial(self) -> ScaleState:
        return ScaleState(scale=self.init_scale, good_units=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class ScaleState:
    """The scale and the good units in a row since it last changed: training state (checkpoints,
    ``--resume``, the state a joiner receives)."""

    scale: float
    good_units: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"ScaleState.scale must be a finite number > 0, got {self.scale!r}")
        if self.good_units < 0:
            raise ValueError(f"ScaleState.good_units must be >= 0, got {self.good_units!r}")

    def as_dict(self) -> dict[str, float | int]:
        """Plain values (msgpack and JSON take them)."""
        return {"scale": self.scale, "good_units": self.good_units}

    @staticmethod
    def from_dict(d: dict[str, float | int]) -> ScaleState:
        return ScaleState(scale=float(d["scale"]), good_units=int(d["good_units"]))


def next_scale(rule: ScaleRule, state: ScaleState, verdict: Verdict) -> ScaleState:
    """The state after a unit with the agreed ``verdict`` (module doc)."""
    if verdict is Verdict.OVERFLOW:
        return ScaleState(scale=max(state.scale * rule.backoff_factor, rule.min_scale), good_units=0)
    if verdict is Verdict.OTHER:
        return state
    good = state.good_units + 1
    if good < rule.growth_interval:
        return replace(state, good_units=good)
    grown = state.scale * rule.growth_factor
    return ScaleState(scale=grown if math.isfinite(grown) else state.scale, good_units=0)


def stage_fp16_refusal(kind: str, schedule: str) -> str:
    """Why the stages of strategy ``kind`` running ``schedule`` cannot train under fp16 (one
    line that names what can), or "" where they can (module doc)."""
    if schedule in FP16_SCHEDULES:
        return ""
    return (
        f"fp16 is not built for strategy {kind} with schedule {schedule} (no flush at which the "
        f"stages could skip an overflowed step together and keep one loss scale); fp16 works with "
        f"{', '.join(FP16_KINDS)} and pipeline with schedule {' or '.join(FP16_SCHEDULES)}; use "
        f"bf16 for {kind} with schedule {schedule}"
    )
