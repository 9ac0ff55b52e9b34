"""The loss scaler of ``job.precision: fp16`` at run time: scales a unit's loss, unscales and checks
gradients, and moves the scale by the pure rule (``sync/loss_scale.py``) from a verdict.

One scaler per replica (the engine's, ``trainer/replica.py``).  Who settles it:

- a strategy that agrees on its gradients (``allreduce``, ``diloco``: ``use_loss_scale``, see
  :func:`agrees_loss_scale`) unscales the REDUCED gradients (or its inner steps' own), folds an
  overflow into the step's vote (failure code :data:`OVERFLOW_CODE`, below a fault's 1 and a
  non-finite value's 2, so the MAX is the agreed verdict) and settles every member's scaler from
  the agreed code: the scales stay equal;
- otherwise (``ps``, ``partial_reduce``, ``adpsgd``: each worker's own update) the step
  (``trainer/step.py``) unscales this worker's gradients, does not apply or push an overflowed
  one and settles this worker's scaler alone.

An overflow is not a non-finite step (``trainer/boundary.py``): the unit is skipped, the scale
backs off, training goes on.  A non-finite LOSS still is one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from flotilla.sync.loss_scale import ScaleRule, ScaleState, Verdict, next_scale
from flotilla.sync.state import all_finite, fused_check_takes

__all__ = [
    "OVERFLOW_CODE",
    "OVERFLOW_REASON",
    "LossScaler",
    "ScaleSlot",
    "agrees_loss_scale",
    "verdict_of_code",
]

# A vote's failure code for "the loss was finite everywhere, a scaled gradient was not" (0: good,
# 1: a member's fault, 2: a non-finite loss or gradient): the MAX keeps the worse of them.
OVERFLOW_CODE = 0.5
OVERFLOW_REASON = "fp16 overflow: the scaled gradients were not finite (step skipped, loss scale backed off)"


def verdict_of_code(code: float) -> Verdict:
    """The scale's verdict of an agreed failure code (module doc)."""
    if code == 0.0:
        return Verdict.GOOD
    return Verdict.OVERFLOW if code == OVERFLOW_CODE else Verdict.OTHER


def agrees_loss_scale(strategy: Any) -> bool:
    """Whether ``strategy`` settles the scale itself from an agreed verdict (it has
    ``use_loss_scale(scaler)``); else the step settles each worker's own."""
    return callable(getattr(strategy, "use_loss_scale", None))


class LossScaler:
    """The scale of one replica (module doc); ``last``: the verdict of the last unit settled (None
    before one, or while a unit runs)."""

    def __init__(self, rule: ScaleRule | None = None) -> None:
        self.rule = rule if rule is not None else ScaleRule()
        self.state = self.rule.initial()
        self.last: Verdict | None = None

    @property
    def scale(self) -> float:
        return self.state.scale

    def begin_unit(self) -> None:
        self.last = None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S`` in float32 (a float16 loss times 2**16 would overflow itself)."""
        return loss.float() * self.state.scale

    def unscale_(self, grads: Sequence[torch.Tensor]) -> bool:
        """Multiply ``grads`` by ``1/S`` in place; whether every element is finite.  One fused
        kernel where torch takes the tensors (``_amp_foreach_non_finite_check_and_unscale_``,
        as ``GradScaler.unscale_``), else per tensor."""
        ts = [g for g in grads if g.numel()]
        if not ts:
            return True
        flag = self.unscale_flag_(ts)
        if flag is not None:
            return not bool(flag.item())
        inv = 1.0 / self.state.scale
        for g in ts:
            g.mul_(inv)
        return all_finite(ts)

    def unscale_flag_(self, grads: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """:meth:`unscale_` without reading the result: a 0-dim float tensor on the gradients'
        device, 1.0 when one was not finite; None where the fused kernel does not take them (the
        gradients are then untouched)."""
        ts = [g for g in grads if g.numel()]
        if not ts:
            return None
        device = ts[0].device
        if not fused_check_takes(ts, device):
            return None
        found = torch.zeros((), device=device)
        inv = torch.full((), 1.0 / self.state.scale, device=device)
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(ts, found, inv)
        except (RuntimeError, TypeError):
            return None
        return found

    def settle(self, verdict: Verdict) -> None:
        """Move the scale by the rule from this unit's (agreed) ``verdict``."""
        self.state = next_scale(self.rule, self.state, verdict)
        self.last = verdict

    def state_dict(self) -> dict[str, float | int]:
        return self.state.as_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = ScaleState.from_dict(state)


class ScaleSlot:
    """Where a strategy that agrees on the scale keeps its replica's scaler: attached by the
    engine (``use_loss_scale``), carried in the strategy's ``state_dict`` (checkpoints,
    ``--resume``, the state a joiner receives).  A state loaded before the scaler is attached
    (a resumed checkpoint) is applied when it is."""

    KEYS = ("loss_scale", "loss_scale_good_units")

    def __init__(self) -> None:
        self.scaler: LossScaler | None = None
        self._pending: dict[str, Any] | None = None

    def attach(self, scaler: LossScaler | None) -> None:
        self.scaler = scaler
        if scaler is not None and self._pending is not None:
            scaler.load_state_dict(self._pending)
            self._pending = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.scaler is None:
            return {}
        s = self.scaler.state
        return {
            "loss_scale": torch.tensor([s.scale], dtype=torch.float64),
            "loss_scale_good_units": torch.tensor([s.good_units], dtype=torch.int64),
        }

    def load(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Take the scale out of ``state``; the rest (the strategy's own)."""
        if "loss_scale" not in state:
            return dict(state)
        got = {
            "scale": float(state["loss_scale"].item()),
            "good_units": int(state["loss_scale_good_units"].item()),
        }
        if self.scaler is not None:
            self.scaler.load_state_dict(got)
        else:
            self._pending = got
        return {k: v for k, v in state.items() if k not in self.KEYS}

    def settle_code(self, code: float) -> None:
        """Settle the attached scaler from an agreed failure code (:func:`verdict_of_code`)."""
        if self.scaler is not None:
            self.scaler.settle(verdict_of_code(code))
