"""Host staging of a PS worker's pushes and pulls (``sync/via_ps.PSSync``; issue 34): the shards
stay on the CPU (as ps-lite's and BytePS's servers do), so every push leaves the device and every
pull comes back to it.  On a CUDA device this module stages both through **pinned** host buffers
with **asynchronous** copies; on any other device it is a pass-through (today's path, bit for bit:
the message plane's codec copies a device tensor with ``.cpu()`` when it encodes it).

Pushes.  A *slot* is one pinned host buffer per parameter (its shape and dtype), allocated on first
use and reused for the rest of the job.  ``to_host(update)`` (the strategy's ``synchronize``, where
the unit's update is final) copies every tensor of the update into a free slot with
``non_blocking`` on a side stream that first waits for the current one, records one event there,
**waits for it** and returns the slot: the push never encodes a buffer a copy is still writing,
and the client's threads never touch the device (a ``.cpu()`` there would queue behind the next
forward pass on the device's stream).

Copies during backward (``hooks=True``, opt-in; the ``server_sgd`` rule, whose update is the
gradient): ``arm`` (the strategy's ``begin_step``) picks the unit's slot, and a
post-accumulate-grad hook on each parameter copies its gradient into it the moment it is final --
during the *last* backward pass of the unit (``defer(True)`` disarms the hooks for the earlier
passes of ``job.accumulate``) -- so the copies overlap the rest of that pass; ``to_host`` then
copies only what the hooks did not (a parameter unused in the last pass, the zeros of a missing
gradient, a gradient whose ``_version`` moved since its copy).  It is off by default because a
change of the gradients *between* backward and the push that does not move ``_version`` cannot be
seen: an fp16 loss scaler's in-place unscale (``torch._amp_foreach_non_finite_check_and_unscale_``)
and writes through ``.data`` are such.

In flight.  The message plane sends the host tensors zero-copy (``comm/codec.py`` wraps their
storage; zmq keeps a reference until the frames left), so a slot handed to a push stays untouched
until the client collected that push's acknowledgement: ``busy()`` (``PSClient.push_in_flight``)
says whether the last push is still out, and the slot last handed is then *in flight*.  At most
one push is in flight (the client's invariant), so two slots always suffice: a synchronous push
(``push_pull``) only ever uses the first, an asynchronous one (cached reads, read-ahead) alternates.
(An attempt that timed out may leave its frames queued in zmq until the peer is reachable; should
they leave after the slot was reused, the HMAC tag, computed when they were encoded, no longer
matches and the shard rejects them unapplied.)

Pulls.  ``target(kind)`` is where a pull lands (``"pull"``; ``"ahead"``: read-ahead's reply in
flight): pinned host buffers, filled by the client's threads with plain host copies.  ``load(kind)``
copies them into the parameters with ``non_blocking`` on the current stream -- the next forward
pass, queued on the same stream, reads them after the copy -- and records an event; ``target``
waits for that event before it hands the buffers to the next pull (never overwrite a buffer a copy
still reads).  Pass-through: ``target("pull")`` is the parameters themselves and ``load`` does
nothing; ``target("ahead")`` is a device tensor per parameter that ``load`` copies in.

Invariants: the values pushed and the weights loaded are those of the pass-through path bit for
bit (copies only; no arithmetic); a slot is never written while it is in flight; a pull buffer is
never written while an earlier host-to-device copy may still read it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

import torch
from torch import nn

from flotilla.core.errors import ConfigError, FlotillaError

__all__ = ["Copies", "CudaCopies", "Fence", "HostStaging", "PlainCopies", "copies_for"]

MAX_SLOTS = 2  # one in flight (at most one push is) + one being filled
TargetKind = Literal["pull", "ahead"]


class Fence(Protocol):
    """The completion of the copies issued before it."""

    def wait(self) -> None: ...


class Copies(Protocol):
    """How host buffers are made and filled: :class:`CudaCopies` on a GPU, :class:`PlainCopies`
    (the same bookkeeping with plain copies) where tests need it without one."""

    pinned: bool

    def host_like(self, t: torch.Tensor) -> torch.Tensor: ...

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def host_fence(self) -> Fence: ...

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def device_fence(self) -> Fence: ...


class _CudaFence:
    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def wait(self) -> None:
        self.event.synchronize()


class CudaCopies:
    """Pinned host buffers; device to host on a side stream ordered after the current stream's
    work so far; host to device on the current stream."""

    pinned = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device)

    def host_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(tuple(t.shape), dtype=t.dtype, pin_memory=True)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            dst.copy_(src, non_blocking=True)
        src.record_stream(self.side)  # (its memory is not reused before the copy read it)

    def host_fence(self) -> Fence:
        return _CudaFence(self.side)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def device_fence(self) -> Fence:
        return _CudaFence(torch.cuda.current_stream(self.device))


class _Done:
    def wait(self) -> None:
        """Plain copies are complete when they return."""


class PlainCopies:
    """Unpinned host buffers and synchronous copies: the staging's bookkeeping without a GPU
    (tests; the reference the CUDA path must equal)."""

    pinned = False

    def host_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(tuple(t.shape), dtype=t.dtype)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def host_fence(self) -> Fence:
        return _Done()

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def device_fence(self) -> Fence:
        return _Done()


def copies_for(params: Mapping[str, torch.Tensor]) -> Copies | None:
    """:class:`CudaCopies` when every parameter is on one CUDA device, else None (pass-through)."""
    devices = {p.device for p in params.values()}
    if len(devices) != 1:
        return None
    (device,) = devices
    return CudaCopies(device) if device.type == "cuda" else None


class HostStaging:
    """The host buffers of one PS worker's trainable ``params`` (module doc).  ``busy()``: whether
    the client still holds the last push handed out; ``copies``: ``"auto"`` (:func:`copies_for`),
    None (pass-through) or a :class:`Copies`; ``hooks``: copy gradients as backward finishes
    them (module doc: only where the update is the gradient and nothing changes the gradients
    between backward and the push)."""

    def __init__(
        self,
        params: Mapping[str, nn.Parameter],
        *,
        busy: Callable[[], bool],
        copies: Copies | None | Literal["auto"] = "auto",
        hooks: bool = False,
    ) -> None:
        self.params = dict(params)
        self.copies: Copies | None = copies_for(self.params) if copies == "auto" else copies
        self._busy = busy
        self.slots: list[dict[str, torch.Tensor]] = []
        self._filling: int | None = None  # the slot this unit's gradients go to
        self._handed: int | None = None  # the slot last handed to a push
        self._copied: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (gradient, its _version)
        self._armed = self._deferred = False
        self._targets: dict[str, dict[str, torch.Tensor]] = {}
        self._loaded: Fence | None = None  # the last load's host-to-device copies
        self._names = {id(p): n for n, p in self.params.items()}
        self._hooks: list[Any] = []
        if self.copies is not None and hooks:
            self._hooks = [
                p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params.values()
            ]

    @property
    def active(self) -> bool:
        """Whether pushes and pulls are staged (False: the pass-through)."""
        return self.copies is not None

    # ------------------------------------------------------------------ pushes
    def in_flight(self) -> int | None:
        """The slot a push may still be reading, or None."""
        return self._handed if self._handed is not None and self._busy() else None

    def arm(self) -> None:
        """Before a unit's first forward pass: pick its slot; the hooks copy into it."""
        if self.copies is None:
            return
        self._filling = self._free_slot()
        self._copied.clear()
        self._armed, self._deferred = True, False

    def defer(self, defer: bool) -> None:
        """Gradient accumulation: while ``defer``, backward passes are not the unit's last."""
        self._deferred = defer

    def to_host(self, update: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The host tensors to push for ``update`` (a device tensor per parameter), every copy
        into them complete; pass-through: ``update`` itself.  The slot is in flight from now on
        while ``busy()``."""
        if self.copies is None:
            return update
        slot = self._filling if self._filling is not None else self._free_slot()
        if slot == self.in_flight():
            raise FlotillaError(f"host staging: slot {slot} is still in flight (a push reads it)")
        bufs = self.slots[slot]
        for name, t in update.items():
            buf = bufs.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                want = "no such parameter" if buf is None else f"{buf.dtype} {tuple(buf.shape)}"
                raise ConfigError(f"host staging: update {name!r} is {t.dtype} {tuple(t.shape)}; {want}")
            done = self._copied.get(name)
            if done is None or done[0] is not t or done[1] != t._version:
                self.copies.to_host(buf, t)
        self.copies.host_fence().wait()
        self._handed, self._filling, self._armed = slot, None, False
        self._copied.clear()
        return {name: bufs[name] for name in update}

    def _free_slot(self) -> int:
        busy = self.in_flight()
        for i in range(len(self.slots)):
            if i != busy:
                return i
        if len(self.slots) == MAX_SLOTS:  # (cannot happen: at most one push is in flight)
            raise FlotillaError(f"host staging: all {MAX_SLOTS} slots are in flight")
        assert self.copies is not None
        self.slots.append({n: self.copies.host_like(p) for n, p in self.params.items()})
        return len(self.slots) - 1

    def _grad_ready(self, p: torch.Tensor) -> None:
        grad = p.grad
        if not self._armed or self._deferred or self._filling is None or grad is None:
            return
        name = self._names[id(p)]
        assert self.copies is not None
        self.copies.to_host(self.slots[self._filling][name], grad)
        self._copied[name] = (grad, grad._version)

    # ------------------------------------------------------------------ pulls
    def target(self, kind: TargetKind = "pull") -> dict[str, torch.Tensor]:
        """Where a pull of ``kind`` lands (module doc); no copy out of it is still running."""
        if self._loaded is not None:
            self._loaded.wait()
            self._loaded = None
        if self.copies is None and kind == "pull":
            return {n: p.data for n, p in self.params.items()}
        if kind not in self._targets:
            make = self.copies.host_like if self.copies is not None else _device_like
            self._targets[kind] = {n: make(p) for n, p in self.params.items()}
        return self._targets[kind]

    def load(self, kind: TargetKind = "pull") -> None:
        """Copy the pull of ``kind`` into the parameters (ordered before the next forward pass)."""
        if self.copies is None and kind == "pull":
            return
        src = self._targets[kind]
        with torch.no_grad():
            for n, p in self.params.items():
                if self.copies is None:
                    p.copy_(src[n])
                else:
                    self.copies.to_device(p.data, src[n])
        if self.copies is not None:
            self._loaded = self.copies.device_fence()

    def close(self) -> None:
        """Remove the hooks (idempotent); the buffers go with the object."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._armed = False


def _device_like(p: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(p, memory_format=torch.contiguous_format)
