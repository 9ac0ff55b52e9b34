"""The stages' verdict on one step of a flushing pipeline schedule (``StageEngine._guard``, before
every stage applies the step's update), and what an applied update needs from the other stages.

The verdict: one MAX all-reduce over the stage group of [the loss not finite (the last stage
flags it), 1 + the last stage whose gradients are not finite (, a newer generation of pipeline
instances seen)], so every stage reaches the same answer: apply, or skip together.  With pipeline
instances side by side the stage's values were summed with the same stage of the other instances
first (``trainer/replica_sum.py``), so every instance reaches it too.

fp16 (``job.precision``; ``sync/scaler.py``, ``sync/loss_scale.py``): the last stage multiplied
every microbatch's loss by the loss scale ``S`` before backward, so every gradient that flowed
back through the stages, and every stage's parameter gradients, are scaled.  Each stage unscales
its own (``x 1/S``: after the sum over instances, before the verdict; one fused kernel that checks
them too).  A finite loss with a non-finite unscaled gradient on ANY stage is an overflow: the
MAX hands it to every stage of every instance, all skip the update, and each settles its scale
from that same agreed verdict (:attr:`StageVerdict.scale`), so the scale stays equal everywhere.
A non-finite loss is a non-finite step, as without fp16 (the scale is left as it is).

After an update is agreed: parameters tied across stages get the sum of their holders' gradients
(:func:`sum_tied_gradients`) and, with ``clip_grad_norm``, every stage clips on the norm of the
whole model's gradient (:func:`clip_stage_gradients`); both see unscaled gradients.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from flotilla.comm.collective import Group
from flotilla.core.log import get_logger
from flotilla.pipeline.model_check import SplitTie
from flotilla.sync.loss_scale import Verdict
from flotilla.sync.scaler import OVERFLOW_REASON, LossScaler
from flotilla.trainer.optim import clip_coefficient
from flotilla.trainer.step import nonfinite_gradient

__all__ = ["StageVerdict", "agree_on_step", "clip_stage_gradients", "sum_tied_gradients"]

log = get_logger("stage-engine")


@dataclass(frozen=True, slots=True)
class StageVerdict:
    """What the stages agreed about one step: ``what`` why its update is skipped ("" apply it: a
    non-finite value's place, or fp16's overflow reason), ``overflow`` whether that skip is an
    fp16 overflow (not a non-finite step), ``moved`` whether a stage saw a newer generation."""

    what: str
    overflow: bool = False
    moved: bool = False

    @property
    def scale(self) -> Verdict:
        """The loss scale's verdict (``sync/loss_scale.py``): the same on every stage."""
        if not self.what:
            return Verdict.GOOD
        return Verdict.OVERFLOW if self.overflow else Verdict.OTHER


def agree_on_step(
    group: Group,
    module: nn.Module,
    *,
    stage_idx: int,
    names: Sequence[str],
    local: str,
    seen: bool | None = None,
    scaler: LossScaler | None = None,
) -> StageVerdict:
    """This stage's part of the verdict (module doc).  ``local``: what this stage found not
    finite (``"loss"``: the last stage's loss; ``"gradient"``: a received gradient, which counts
    as this stage's gradient); ``seen``: a newer generation seen (None: no such flag);
    ``scaler``: fp16's loss scale (the gradients are unscaled here; the caller settles it)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if scaler is not None:
        grad = "" if scaler.unscale_(grads) and local != "gradient" else "scaled gradient"
    else:
        grad = "received gradient" if local == "gradient" else "" if local else nonfinite_gradient(module)
    values = [1.0 if local == "loss" else 0.0, float(stage_idx + 1) if grad else 0.0]
    if seen is not None:
        values.append(1.0 if seen else 0.0)
    flags = torch.tensor(values)
    group.allreduce(flags, "max")
    moved = seen is not None and bool(flags[2] > 0)
    if flags[0] > 0:
        return StageVerdict(f"loss on stage {names[-1]}", moved=moved)
    if flags[1] > 0:
        stage = int(flags[1]) - 1
        if scaler is not None:  # (routine while the scale settles: not a warning)
            log.debug("stage %s: fp16 overflow at scale %g: step skipped", names[stage_idx], scaler.scale)
            return StageVerdict(OVERFLOW_REASON, overflow=True, moved=moved)
        if stage == stage_idx:
            log.warning("stage %s: non-finite %s", names[stage], grad)
        return StageVerdict(f"gradient on stage {names[stage]}", moved=moved)
    return StageVerdict("", moved=moved)


def sum_tied_gradients(group: Group, module: nn.Module, ties: Sequence[SplitTie]) -> None:
    """Every parameter tied across stages gets the sum of its holders' gradients (one SUM
    all-reduce per tie over the stage group; a stage not holding it adds zeros), so the
    holders apply the same update and their copies stay bitwise equal."""
    own = {id(p) for p in module.parameters()}
    for tie in ties:
        p = tie.param
        held = id(p) in own
        buf = p.grad.detach().clone() if held and p.grad is not None else torch.zeros_like(p)
        group.allreduce(buf, "sum")
        if held:
            p.grad = buf


def clip_stage_gradients(
    group: Group, module: nn.Module, max_norm: float, not_counted: Collection[int] = ()
) -> None:
    """Clip this stage's gradients on the norm over ALL stages' gradients (one SUM all-reduce
    of the squared norms), so the pipeline clips as one model would; ``not_counted``: ids of the
    tied parameters another stage counts (each tie once)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    counted = [p.grad for p in module.parameters() if p.grad is not None and id(p) not in not_counted]
    sq = [g.detach().double().pow(2).sum() for g in counted]
    total = (torch.stack(sq).sum() if sq else torch.zeros((), dtype=torch.float64)).reshape(1)
    group.allreduce(total, "sum")
    coef = clip_coefficient(float(total.item()), max_norm)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
