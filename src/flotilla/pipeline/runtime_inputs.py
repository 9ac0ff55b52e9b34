"""What a stage runtime (``pipeline/runtime.StageRuntime``) is given besides its module and
groups: where its microbatches come from (:class:`StageData`) and what it records and checks
(:class:`RuntimeOptions`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["RuntimeOptions", "StageData"]


class StageData(Protocol):
    """Where a stage gets its microbatches (stage 0) and targets (last stage)."""

    def batch_size(self, microbatch_idx: int) -> int: ...
    def input(self, microbatch_idx: int) -> torch.Tensor: ...
    def target(self, microbatch_idx: int) -> torch.Tensor: ...
    def loss_scale(self, microbatch_idx: int) -> float: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeOptions:
    prefetch_recvs: int = 2
    record_timeline: bool = True
    record_versions: bool = False
    track_memory: bool = False
    check_grads_in: bool = False  # mark a minibatch whose received gradient is not finite (and pass it on)
    # every message after a header with its batch size (a batch's split may change while receives
    # are posted ahead: pipeline/stage_comm.py)
    sized_messages: bool = False
