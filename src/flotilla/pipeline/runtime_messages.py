"""A pipeline stage's messages: what :class:`~flotilla.pipeline.runtime.StageRuntime` sends for a
``SendAct`` / ``SendGrad`` and keeps of a ``RecvAct`` / ``RecvGrad`` (a mixin; the transport is
``flotilla.pipeline.stage_comm.StageComm``).

- An activation leaves detached, with the version its forward used (the tag vertical sync
  checks); a received activation (and its tag) waits in ``inputs`` for its forward.
- A gradient leaves as the backward computed it -- or, with ``check_grads_in``, as NaN when its
  minibatch was marked not finite here, so every stage upstream learns of it (a ReLU may mask a
  NaN); a received gradient that is not finite marks its minibatch (``nonfinite``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flotilla.pipeline.schedule import RecvAct, RecvGrad, SendAct, SendGrad
from flotilla.pipeline.stage_pass import tensor_finite

__all__ = ["StageMessages"]


class StageMessages:
    """The runtime's send and receive actions (module doc)."""

    comm: Any  # StageComm
    options: Any  # RuntimeOptions
    schedule: Any  # Schedule
    passes: dict[int, Any]
    inputs: dict[int, torch.Tensor]
    tags_in: dict[int, int]
    grads_in: dict[int, torch.Tensor]
    grads_out: dict[int, torch.Tensor]
    nonfinite: dict[int, str]

    def _send(self, action: SendAct | SendGrad) -> None:
        b = action.microbatch_idx
        if isinstance(action, SendAct):
            self.comm.send(action, self.passes[b].out.detach(), self.passes[b].version)
        else:
            grad = self.grads_out.pop(b)
            if self.options.check_grads_in and self.schedule.minibatch_of(b) in self.nonfinite:
                grad = torch.full_like(grad, math.nan)  # tell the stages upstream (a ReLU may mask a NaN)
            self.comm.send(action, grad, None)

    def _recv(self, action: RecvAct | RecvGrad) -> None:
        buf, tag = self.comm.recv(action)
        if isinstance(action, RecvAct):
            self.inputs[action.microbatch_idx] = buf
            if tag is not None:
                self.tags_in[action.microbatch_idx] = tag
        else:
            self.grads_in[action.microbatch_idx] = buf
            if self.options.check_grads_in and not tensor_finite(buf):
                self.nonfinite.setdefault(self.schedule.minibatch_of(action.microbatch_idx), "gradient")
