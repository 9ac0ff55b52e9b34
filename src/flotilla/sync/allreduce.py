"""Strategy ``allreduce``: bucketed ring all-reduce overlapped with backward, atomic step (SPEC §4, §7).

How a step runs
1. ``begin_step`` arms the gradient hooks.  During backward each parameter's gradient is copied
   into its bucket's flat buffer as soon as it is accumulated; a full bucket is all-reduced
   asynchronously (buckets launch strictly in index order, so every worker issues the same
   sequence of collectives).
2. ``synchronize`` waits for every bucket, then runs one small *vote* all-reduce (MAX,
   ``Group.vote``: refused by a member that stopped running while it was in flight) carrying
   the loop's ``Proposal``: ``[local_failure, pending_epoch, stop, switch]``.  The step is
   **committed** only if no worker reported a failure (an injected fault, or a non-finite loss or
   gradient: ``local_ok`` False); otherwise every worker discards it.  The vote also makes every
   worker learn a pending membership change, a stop or a strategy switch at the same boundary.
3. Only after a committed vote are the reduced gradients written back into ``param.grad`` and the
   optimizer stepped, so no replica ever holds a half-applied update.  One member alone with a
   fused Adam/AdamW (CUDA parameters, docs/gpu.md) launches the step with the device-side
   non-finite flag, which makes the kernel skip it, and reads the flag afterwards: the same
   outcome (a non-finite step changes nothing) without waiting for the host first.

``job.precision: fp16`` (``sync/scaler.py``): the reduced gradients are unscaled (``1/S``, one
fused kernel that also checks them) before the vote; finite losses with non-finite reduced
gradients are an overflow (failure code ``OVERFLOW_CODE``), which every member learns from the
vote's MAX and settles its scale from: the step is skipped everywhere, the scales stay equal.

Buffers (BatchNorm's running statistics, ...) follow ``sync/buffers.py``: saved in ``begin_step``,
all-reduced after the last bucket (floats averaged, integers rank 0's), written at a commit and
restored at a discard, so replicas' whole ``state_dict`` (and digests) agree after every step.

``grad_dtype: bf16`` (off by default): each float32 bucket travels as bfloat16 -- cast down at its
launch, summed in bfloat16 along the ring, cast back before the vote -- half the bytes of float32
at bfloat16's 8-bit mantissa (DDP's ``bf16_compress_hook`` does the same).  The reduced bytes are
the same on every replica, so the step stays atomic and the replicas identical.

Losses are expected to be scaled by ``1 / global_batch`` (sum over the local samples), so the SUM
all-reduce yields exactly the global-batch mean gradient however the batch is split.

If a collective itself fails (a peer vanished, a timeout, an abort), the step is discarded and
``synchronize`` returns ``Outcome.group_failed`` (the group has already released its sockets, so
peers blocked on this worker fail at once too); the loop recovers into a new view.  Assumption recorded
for ring repair (SPEC §7): a worker that completed the vote knows every worker voted and holds the
fully reduced gradients of that step (``last_voted_step``), which is what a roll-forward needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from flotilla.comm.collective import Group, Handle
from flotilla.core.errors import CollectiveError
from flotilla.sync.allreduce_solo import commit_alone, discard_reason
from flotilla.sync.base import Outcome, Proposal, Regime, SyncStrategy, Traits
from flotilla.sync.buffers import ReplicaBuffers
from flotilla.sync.plan import plan_buckets
from flotilla.sync.scaler import OVERFLOW_CODE, LossScaler, ScaleSlot
from flotilla.sync.state import all_finite, loss_finite

__all__ = [
    "BucketedAllReduce",
    "Decision",
    "plan_buckets",
]


Decision = Outcome  # the vote's result (name kept for callers of the previous API)


@dataclass(slots=True)
class _Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor
    pending: int = 0
    handle: Handle | None = None
    wire: torch.Tensor | None = None  # ``grad_dtype: bf16``: what travels (``flat`` cast down)


class BucketedAllReduce(SyncStrategy):
    """Gradient synchronisation for one replica; rebind to a new group after a membership change.

    With ``optimizer`` the strategy clears the gradients in ``begin_step`` and, after a committed
    vote, writes the reduced gradients back and steps it (the whole atomic step); without, the
    caller does both (``write_back``)."""

    kind = "allreduce"
    end_wait_s = 120.0  # (every member trained the same last step: any holds the final weights)
    traits = Traits(regime=Regime.VOTE, checks_gradients=True)
    checks_loss_on_device = True  # (Proposal.loss_check: read with the vote, or after the step alone)

    def __init__(
        self,
        model: nn.Module,
        *,
        bucket_bytes: int,
        optimizer: torch.optim.Optimizer | None = None,
        on_bucket_ready: Callable[[int], None] | None = None,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        if not params:
            raise ValueError("model has no trainable parameters")
        groups = plan_buckets([p.numel() * p.element_size() for p in params], bucket_bytes)
        self._buckets = [self._make_bucket([params[i] for i in g]) for g in groups]
        # (only float32 buckets are cast down: a bucket of another dtype travels as it is)
        self._wire_dtype = wire_dtype
        self._where = {id(p): (b, j) for b, bk in enumerate(self._buckets) for j, p in enumerate(bk.params)}
        self._group: Group | None = None
        self.optimizer = optimizer
        self._on_ready = on_bucket_ready
        self._active = False
        self._deferred = False  # gradient accumulation: passes before the last add, no bucket
        self._next_launch = 0
        self._launch_error: CollectiveError | None = None
        self.step = 0
        self.last_voted_step = -1
        self._solo = False
        self._closed = False
        self._params = params
        self.buffers = ReplicaBuffers(model)
        self.scale = ScaleSlot()  # job.precision fp16: this replica's loss scaler
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]

    @staticmethod
    def _make_bucket(params: list[nn.Parameter]) -> _Bucket:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        flat = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        return _Bucket(params=params, offsets=offsets, flat=flat)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def bind(self, group: Group | None) -> None:
        self._group = group
        # Fresh bucket buffers for every group: an all-reduce abandoned in a broken group may
        # still complete later (a frozen peer wakes up and finishes its part of the ring) and
        # write into the buffers it was given -- those must never be the ones a newer step uses.
        # one member: nothing to reduce -- no hooks, bucket copies or collectives (same arithmetic)
        self._solo = group is not None and group.world_size == 1
        for b in self._buckets:
            b.flat = torch.zeros_like(b.flat)
            cast = self._wire_dtype is not None and b.flat.dtype == torch.float32 and not self._solo
            b.wire = torch.zeros_like(b.flat, dtype=self._wire_dtype) if cast else None
        if self._solo and self._hooks:
            self._remove_hooks()
        elif not self._solo and not self._hooks and not self._closed:
            self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self._params]

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def close(self) -> None:
        self._closed = True
        self._remove_hooks()

    def use_loss_scale(self, scaler: LossScaler | None) -> None:
        """``job.precision: fp16``: unscale the reduced gradients and settle ``scaler`` from
        every step's vote (module doc)."""
        self.scale.attach(scaler)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.scale.state_dict()

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        super().load_state_dict(self.scale.load(state))

    # ------------------------------------------------------------------ during backward
    def begin_step(self, step: int) -> None:
        if self._group is None:
            raise CollectiveError("no group bound")
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.step = step
        self._deferred = False
        self.buffers.save()
        self._launch_error = None
        self._next_launch = 0
        for b in self._buckets:
            b.pending = len(b.params)
            b.handle = None
        self._active = not self._solo

    def defer_reduction(self, defer: bool) -> None:
        self._deferred = defer

    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self._active or self._deferred:
            return
        b_idx, j = self._where[id(p)]
        bucket = self._buckets[b_idx]
        n = p.numel()
        bucket.flat[bucket.offsets[j] : bucket.offsets[j] + n].copy_(p.grad.reshape(-1))  # type: ignore[union-attr]
        bucket.pending -= 1
        if bucket.pending == 0:
            if self._on_ready is not None:
                self._on_ready(b_idx)
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            idx = self._next_launch
            self._next_launch += 1
            b = self._buckets[idx]
            sent = b.flat
            if b.wire is not None:  # (the sum travels and accumulates in the wire's dtype)
                sent = b.wire
                sent.copy_(b.flat)
            try:
                b.handle = self._group.allreduce_async(sent)  # type: ignore[union-attr]
            except CollectiveError as exc:  # (inside backward: kept for synchronize, never raised here)
                self._launch_error = exc
                self._next_launch = len(self._buckets)
                return

    # ------------------------------------------------------------------ after backward
    def synchronize(self, proposal: Proposal = Proposal()) -> Outcome:
        """Wait for every bucket and vote.  With an optimizer, a committed step is applied here.
        A failed collective discards the step: ``Outcome.group_failed``."""
        self._active, self._deferred = False, False
        if self._solo:
            return self._synchronize_alone(proposal)
        try:
            for b in self._buckets:  # parameters unused in backward contribute zeros
                if b.pending:
                    for j, p in enumerate(b.params):
                        if p.grad is None:
                            b.flat[b.offsets[j] : b.offsets[j] + p.numel()].zero_()
                    b.pending = 0
            self._launch_ready()
            if self._launch_error is not None:  # the group broke before a bucket could launch
                raise self._launch_error
            self.buffers.launch(self._group)  # type: ignore[arg-type]
            for b in self._buckets:
                b.handle.wait()  # type: ignore[union-attr]
                b.handle = None
                if b.wire is not None:
                    b.flat.copy_(b.wire)  # (every replica casts the same reduced bytes back)
            self.buffers.wait()
            # failure code: 2 = a non-finite loss/gradient somewhere, 1 = another local fault (a
            # test's fault plan: ``Group.vote``).
            # The reduced gradients are equal on every replica, so checking them here decides
            # alike everywhere (and catches a replica whose gradient overflowed).
            failed = self._failure_code(proposal)
            vote = torch.tensor(
                [failed, float(proposal.pending_epoch), float(proposal.stop), float(proposal.switch)],
                dtype=torch.float64,
            )
            self._group.vote(vote)  # type: ignore[union-attr]
        except CollectiveError as exc:
            for b in self._buckets:
                b.handle = None
            self.buffers.restore()
            return Outcome.group_failed(str(exc))
        self.last_voted_step = self.step
        failed_v, epoch_v, stop_v, switch_v = vote.tolist()
        self.scale.settle_code(failed_v)
        committed = failed_v == 0.0
        if committed:
            self.buffers.apply(self._group.world_size)  # type: ignore[union-attr]
        else:
            self.buffers.restore()
        if committed and self.optimizer is not None:
            self.write_back()
            self.optimizer.step()
        return Outcome(
            committed=committed,
            pending_epoch=int(epoch_v),
            stop=stop_v > 0,
            switch=int(switch_v),
            local_ok=failed_v < 2.0,
            reason=discard_reason(failed_v),
        )

    def _failure_code(self, proposal: Proposal) -> float:
        """This member's failure code for the vote: 2.0 a non-finite loss (or reduced gradient,
        without a loss scale), ``OVERFLOW_CODE`` an fp16 overflow, else 0.0."""
        flats = [b.flat for b in self._buckets]
        scaler = self.scale.scaler
        if scaler is not None:
            grads_ok = scaler.unscale_(flats)  # (always: the write-back reads them unscaled)
            if not (proposal.local_ok and loss_finite(proposal)):
                return 2.0
            return 0.0 if grads_ok else OVERFLOW_CODE
        finite = proposal.local_ok and loss_finite(proposal) and all_finite(flats)
        return 0.0 if finite else 2.0

    def _synchronize_alone(self, proposal: Proposal) -> Outcome:
        """A one-member view: ``sync/allreduce_solo.py`` decides and applies the step."""
        g = self._group
        if g is None or g.aborted:
            self.buffers.restore()
            return Outcome.group_failed(f"group {g.abort_reason if g is not None else 'unbound'}")
        vote = torch.zeros(1, dtype=torch.float64)
        try:
            g.vote(vote)  # (the identity: but a test's fault plan may fail it, as in any vote)
        except CollectiveError as exc:
            self.buffers.restore()
            return Outcome.group_failed(str(exc))
        self.last_voted_step = self.step
        return commit_alone(
            self._params, self.optimizer, self.buffers, proposal, failed=vote.item() > 0, scale=self.scale
        )

    def write_back(self) -> None:
        """Point ``param.grad`` at the reduced gradients (call only after a committed vote).

        The gradients become views of the bucket buffers (no copy).  That is safe because a step
        starts with ``zero_grad(set_to_none=True)`` and the buffers are rewritten only by the next
        step's backward, after the optimizer has consumed them.  (One member: the gradients
        already are the reduced ones.)
        """
        if self._solo:
            return
        for b in self._buckets:
            for j, p in enumerate(b.params):
                p.grad = b.flat[b.offsets[j] : b.offsets[j] + p.numel()].view_as(p)
