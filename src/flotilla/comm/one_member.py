"""The backend of a one-member group (:class:`~flotilla.comm.collective.Group` with
``world_size == 1``): what a membership view of one worker, or a group formed of one member,
runs its collectives on."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Done", "OneMember"]


class Done:
    """A finished collective: what every collective of a one-member group is."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class OneMember:
    """The backend of a one-member group.  A collective over one member is the identity (the sum,
    maximum or broadcast of one tensor is that tensor), so nothing is started: no gloo group, no
    rendezvous, and no transport thread (gloo's wakes about 100 times a second, and on a small
    machine each wake-up preempts a training thread: 5% of a 1-worker job's speed here)."""

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Done:
        return Done()

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Done:
        return Done()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Done:
        raise RuntimeError("a one-member group has no peer to send to")

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Done:
        raise RuntimeError("a one-member group has no peer to receive from")

    def shutdown(self) -> None:
        pass
