"""The buffer policy of data parallelism (``allreduce``): every replica's buffers agree after every
committed step, and a discarded step leaves them as they were.

Buffers are the tensors a model keeps besides its parameters (``model.buffers()``: BatchNorm's
``running_mean``/``running_var``/``num_batches_tracked``, a model's own counters or masks).  The
forward pass may change them (BatchNorm updates its running statistics on the samples of this
replica's shard), so without a policy each replica's buffers would follow its own shard and the
replicas' state (and digests) would drift apart.

Policy (``average``, the only one): at each commit the buffers are all-reduced together, in one
float64 collective launched right after the gradient buckets and waited for with them:

- a floating-point buffer becomes the **mean of the replicas' values** (summed in float64 and
  divided by the view's size, then cast back: replicas that hold the same value keep it bitwise,
  so constant buffers such as masks never drift; the reduced sum is the same bytes on every rank,
  so every replica ends with identical buffers);
- any other buffer (integer counters such as ``num_batches_tracked``, booleans) takes **rank 0's
  value** (the others contribute zero to the sum), like DDP's ``broadcast_buffers`` (exact up
  to 2**53, float64's integers).

The mean is one collective per step (DDP's broadcast from rank 0 costs the same collective) and
gives running statistics that reflect every shard of the global batch rather than rank 0's third
of it.  Its cost is that of a gradient bucket of ``2 x`` the buffers' float32 bytes: for
BatchNorm, 2 floats per channel per layer (``docs/allreduce.md``, measured there).

Atomicity: :meth:`ReplicaBuffers.save` keeps a copy of the buffers before the step's forward pass;
a discarded step (a failed vote, a broken group) :meth:`restore`\\ s them, so a redone step
updates the running statistics once, exactly as an undisturbed run does.  A newcomer receives the
buffers with the rest of the ``state_dict`` (``sync/state.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from flotilla.comm.collective import Group, Handle

__all__ = ["ReplicaBuffers"]


class ReplicaBuffers:
    """The buffers of one replica and their per-commit reduction (see the module doc)."""

    def __init__(self, model: nn.Module) -> None:
        seen: set[int] = set()
        self.buffers: list[torch.Tensor] = []
        for b in model.buffers():
            if id(b) not in seen and b.numel():
                seen.add(id(b))
                self.buffers.append(b)
        self._floating = [b.is_floating_point() for b in self.buffers]
        total = sum(b.numel() for b in self.buffers)
        device = self.buffers[0].device if self.buffers else torch.device("cpu")
        self._flat = torch.zeros(total, dtype=torch.float64, device=device)
        self._saved: list[torch.Tensor] = [torch.empty_like(b) for b in self.buffers]
        self._handle: Handle | None = None

    def __bool__(self) -> bool:
        return bool(self.buffers)

    @property
    def num_bytes(self) -> int:
        """Bytes one reduction sends (float64 of every buffer element)."""
        return self._flat.numel() * self._flat.element_size()

    def save(self) -> None:
        """Before the step's forward pass: remember the buffers (for :meth:`restore`)."""
        with torch.no_grad():
            for saved, b in zip(self._saved, self.buffers, strict=True):
                saved.copy_(b)

    def restore(self) -> None:
        """The step was discarded: put back the buffers :meth:`save` remembered."""
        self._handle = None
        with torch.no_grad():
            for saved, b in zip(self._saved, self.buffers, strict=True):
                b.copy_(saved)

    def launch(self, group: Group) -> None:
        """Start the reduction of the buffers as they are after this step's forward passes.
        Raises :class:`~flotilla.core.errors.CollectiveError` if the group is broken."""
        if not self.buffers:
            return
        self._flat = torch.empty_like(self._flat)  # (fresh: an abandoned reduction may still land)
        offset = 0
        with torch.no_grad():
            for b, floating in zip(self.buffers, self._floating, strict=True):
                n = b.numel()
                view = self._flat[offset : offset + n]
                if floating or group.rank == 0:
                    view.copy_(b.reshape(-1))
                else:
                    view.zero_()
                offset += n
        self._handle = group.allreduce_async(self._flat)

    def wait(self) -> None:
        """Wait for the reduction :meth:`launch` started (CollectiveError if the group broke)."""
        if self._handle is not None:
            self._handle.wait()

    def apply(self, world_size: int) -> None:
        """The step committed: every buffer takes its reduced value (module doc)."""
        if self._handle is None:
            return
        self._handle = None
        offset = 0
        with torch.no_grad():
            for b, floating in zip(self.buffers, self._floating, strict=True):
                n = b.numel()
                view = self._flat[offset : offset + n]
                if floating:
                    view = view / world_size
                b.copy_(view.reshape(b.shape).to(b.dtype))
                offset += n
