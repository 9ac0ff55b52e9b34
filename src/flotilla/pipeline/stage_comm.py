"""Point-to-point traffic of one pipeline stage for one run of its action list (SPEC §3.3).

``StageComm`` is the communication half of ``flotilla.pipeline.runtime.StageRuntime``:

- sends (``SendAct``/``SendGrad``) are asynchronous over the stage's ``EpochGroup`` (rank ==
  stage_idx); each tensor is kept alive until its send completes (``drain``);
- receives (``RecvAct``/``RecvGrad``) are posted ``prefetch`` actions ahead, in action-list order,
  into buffers shaped from the boundary ``ActivationSpec`` and the microbatch size; ``recv`` waits
  for the oldest posted one, which must be the action being executed (each directed link is FIFO,
  as the schedule IR requires);
- with vertical sync, every activation travels with a one-element version tag on its own tag
  (``TAG_VERSION``), sent before the activation and returned by ``recv``;
- with ``sized`` messages (a strategy whose instances' share of a batch may change while
  receives are already posted: HetPipe's data views after an eviction), every activation and
  gradient travels after a one-element header with its batch size (``TAG_SIZE``): the headers
  are what is prefetched, each buffer is shaped from its header when its receive is executed.

Every wait is bounded by the group's timeout (``CollectiveError`` on expiry); point-to-point
waits are whole, never sliced (``comm/collective.py``: a timed-out gloo send/recv wait breaks the
group).  A failed peer still fails the wait at once (its sockets close).  ``TAG_EVAL`` carries
the activations of an evaluation pass.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from flotilla.comm.collective import Group, Handle
from flotilla.pipeline.schedule import Action, RecvAct, RecvGrad, SendAct, SendGrad, format_action
from flotilla.pipeline.split import ActivationSpec
from flotilla.pipeline.timeline import ScheduleError

__all__ = ["TAG_ACT", "TAG_EVAL", "TAG_GRAD", "TAG_SIZE", "TAG_VERSION", "StageComm"]

TAG_ACT, TAG_GRAD, TAG_VERSION, TAG_EVAL, TAG_SIZE = 1, 2, 3, 4, 5


@dataclass(slots=True)
class _Posted:
    action_idx: int
    buf: torch.Tensor  # (sized messages: the size header's)
    handle: Handle
    tag_buf: torch.Tensor | None
    tag_handle: Handle | None


class StageComm:
    """Sends and prefetched receives of one stage (see the module docstring)."""

    def __init__(
        self,
        group: Group | None,
        *,
        stage_idx: int,
        actions: Sequence[Action],
        specs: tuple[ActivationSpec | None, ActivationSpec | None],
        batch_size: Callable[[int], int],
        prefetch: int,
        vertical_sync: bool,
        device: torch.device | None = None,
        sized: bool = False,
    ) -> None:
        """``device``: where received activations and gradients land (the stage's; the group
        stages them through host memory where its transport needs it: ``comm/collective.py``)."""
        self._group, self.stage_idx, self.actions = group, stage_idx, actions
        self.device = device if device is not None else torch.device("cpu")
        self.in_spec, self.out_spec = specs
        self.batch_size, self.vertical_sync, self.sized = batch_size, vertical_sync, sized
        self.prefetch = max(1, prefetch)
        self.recv_positions = [i for i, a in enumerate(actions) if isinstance(a, (RecvAct, RecvGrad))]
        self.next_recv = 0
        self.posted: deque[_Posted] = deque()
        self.pending_sends: list[tuple[Handle, torch.Tensor]] = []

    @property
    def group(self) -> Group:
        if self._group is None:
            raise ScheduleError(
                f"stage {self.stage_idx}: the schedule communicates but the stage has no group"
            )
        return self._group

    def send(self, action: SendAct | SendGrad, tensor: torch.Tensor, version: int | None) -> None:
        """Start sending ``tensor`` (and, for a vertical-sync activation, its ``version`` tag first)."""
        peer = action.peer_stage
        if isinstance(action, SendAct) and self.vertical_sync:
            if version is None:
                raise ScheduleError(f"stage {self.stage_idx}: {format_action(action)} needs a version tag")
            vtag = torch.tensor([version], dtype=torch.int64)
            self.pending_sends.append((self.group.send(vtag, peer, TAG_VERSION), vtag))
        tensor = tensor.contiguous()
        if self.sized:
            size = torch.tensor([tensor.shape[0]], dtype=torch.int64)
            self.pending_sends.append((self.group.send(size, peer, TAG_SIZE), size))
        tag = TAG_ACT if isinstance(action, SendAct) else TAG_GRAD
        self.pending_sends.append((self.group.send(tensor, peer, tag), tensor))
        self.drain(wait=False)

    def post_recvs(self) -> None:
        """Post receives until ``prefetch`` are outstanding (or none are left)."""
        while len(self.posted) < self.prefetch and self.next_recv < len(self.recv_positions):
            idx = self.recv_positions[self.next_recv]
            action = self.actions[idx]
            assert isinstance(action, (RecvAct, RecvGrad))
            b, peer = action.microbatch_idx, action.peer_stage
            tag_buf = tag_handle = None
            if isinstance(action, RecvAct) and self.vertical_sync:
                tag_buf = torch.zeros(1, dtype=torch.int64)
                tag_handle = self.group.recv(tag_buf, peer, TAG_VERSION)
            if self.sized:  # (the header now; the tensor's buffer once it says the size)
                buf = torch.zeros(1, dtype=torch.int64)
                handle = self.group.recv(buf, peer, TAG_SIZE)
            else:
                spec = self._spec(action)
                buf = torch.empty(spec.for_batch(self.batch_size(b)), dtype=spec.dtype, device=self.device)
                handle = self.group.recv(buf, peer, TAG_ACT if isinstance(action, RecvAct) else TAG_GRAD)
            self.posted.append(_Posted(idx, buf, handle, tag_buf, tag_handle))
            self.next_recv += 1

    def recv(self, action: RecvAct | RecvGrad) -> tuple[torch.Tensor, int | None]:
        """Wait for ``action``'s message: ``(tensor, version tag or None)``."""
        posted = self.posted.popleft()
        if self.actions[posted.action_idx] is not action:
            raise ScheduleError(
                f"stage {self.stage_idx}: receive posted for action {posted.action_idx} out of order"
            )
        tag = None
        if posted.tag_handle is not None and posted.tag_buf is not None:
            posted.tag_handle.wait()
            tag = int(posted.tag_buf[0])
        posted.handle.wait()
        if not self.sized:
            return posted.buf, tag
        spec = self._spec(action)
        buf = torch.empty(spec.for_batch(int(posted.buf[0])), dtype=spec.dtype, device=self.device)
        self.group.recv(buf, action.peer_stage, TAG_ACT if isinstance(action, RecvAct) else TAG_GRAD).wait()
        return buf, tag

    def _spec(self, action: RecvAct | RecvGrad) -> ActivationSpec:
        spec = self.in_spec if isinstance(action, RecvAct) else self.out_spec
        if spec is None:
            raise ScheduleError(f"stage {self.stage_idx}: no activation spec for {format_action(action)}")
        return spec

    def drain(self, *, wait: bool) -> None:
        """Forget completed sends; with ``wait``, first wait for all of them."""
        if wait:
            for handle, _ in self.pending_sends:
                handle.wait()
            self.pending_sends.clear()
            return
        self.pending_sends = [(h, t) for h, t in self.pending_sends if not h.is_completed()]
