"""Learning-rate schedules as pure data: the factor of the base learning rate at each step.

One definition of each curve serves every place where the learning rate follows the step: the
workers' optimizers (``trainer/optim.py`` wraps :meth:`factor` in
``torch.optim.lr_scheduler.LambdaLR``) and the parameter server's SGD (``ps/store.py``: the SGD
step of global clock c uses ``lr * factor(c)``, :meth:`flotilla.ps.config.ServerSGD.lr_at`).
Pure: no torch, no I/O; a schedule holds no state besides its settings, so the learning rate of
step s is a function of s alone (a resumed run only needs to know its step).

Steps count from 0: step s is the (s + 1)-th optimizer step.

- :class:`Constant`: factor 1.
- :class:`LinearWarmup` (``warmup_steps`` W): ``(s + 1) / W`` for s < W (from lr/W up to lr at
  step W - 1), then 1.
- :class:`Cosine` (``warmup_steps`` W, ``decay_steps`` T, ``min_factor`` m): the same warmup,
  then half a cosine from 1 at step W down to m at step T: ``m + (1 - m)·(1 + cos(π·p))/2`` with
  ``p = (s - W) / (T - W)``; m from step T on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flotilla.core.checks import require_int, require_number
from flotilla.core.errors import ConfigError

__all__ = ["Constant", "Cosine", "LRSchedule", "LinearWarmup"]


def _warmup(step: int, warmup_steps: int) -> float:
    return (step + 1) / warmup_steps if step < warmup_steps else 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Constant:
    """The base learning rate at every step."""

    def factor(self, step: int) -> float:
        return 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearWarmup:
    """Linear warmup over ``warmup_steps`` steps, then the base learning rate."""

    warmup_steps: int

    def __post_init__(self) -> None:
        require_int("LinearWarmup", "warmup_steps", self.warmup_steps, min=1)

    def factor(self, step: int) -> float:
        return _warmup(step, self.warmup_steps)


@dataclass(frozen=True, kw_only=True, slots=True)
class Cosine:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_factor`` at ``decay_steps``."""

    decay_steps: int
    warmup_steps: int = 0
    min_factor: float = 0.0

    def __post_init__(self) -> None:
        require_int("Cosine", "warmup_steps", self.warmup_steps, min=0)
        require_int("Cosine", "decay_steps", self.decay_steps, min=1)
        require_number("Cosine", "min_factor", self.min_factor, min=0.0, max=1.0)
        if self.decay_steps <= self.warmup_steps:
            raise ConfigError(
                f"Cosine.decay_steps ({self.decay_steps}) must be > warmup_steps ({self.warmup_steps})"
            )

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return _warmup(step, self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps))
        return self.min_factor + (1.0 - self.min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))


LRSchedule = Constant | LinearWarmup | Cosine
