"""Strategy ``diloco``: DiLoCo and LocalSGD (Douillard et al., 2023; Lin et al., 2020) -- H local
steps, then one atomic outer step on the averaged pseudo-gradient.

Per commit unit (``inner_steps`` = H minibatches, ``Traits.steps_per_commit``)::

    w_sync = w                                  # the replicas' common weights at the unit's start
    H times: backward on this worker's shard -> inner optimizer step (the job's optimizer)
    Δ = w_sync - w_local                        # this worker's pseudo-gradient
    all-reduce SUM of Δ over the view, / N      # the averaged pseudo-gradient (same bytes everywhere)
    vote [failure, pending epoch, stop, switch] # one small all-reduce, as under ``allreduce``
    committed: w = w_sync; outer step with gradient Δ̄ (Nesterov SGD, lr ``outer_lr``, momentum
               ``outer_momentum``); buffers averaged
    discarded: w = w_sync; the inner optimizer's state and the buffers as they were at the start

LocalSGD is ``outer_lr: 1, outer_momentum: 0`` (the outer step then sets w to the replicas' mean).

Invariants
- **Atomic outer step**: the weights change only after a committed vote; a broken collective or a
  failed vote puts back the weights, the inner optimizer's state and the buffers of the unit's
  start on every member, so a redone unit repeats exactly the same arithmetic (``on_abort: redo``:
  the samples of a discarded unit are trained again, none twice; ``drop`` records them as dropped).
- **Identical replicas after every outer step**: every member starts the unit from the same
  ``w_sync`` and outer momentum and applies the same reduced bytes, so digests agree.
- **State**: the outer optimizer's momentum is the strategy's state (``state_dict``): joiners
  receive it with the model, checkpoints keep it.  The inner optimizer's state is each worker's
  own (as in DiLoCo): a joiner takes its donor's with the model; it is the strategy's *local*
  state (``local_state_dict``), which every rank writes beside rank 0's checkpoint, so a resumed
  worker takes back its rank's.
- Gradients are scaled by the view's size before each inner step: the loss is summed over the
  local samples and divided by the global batch, so ``N x`` gives this worker's mean gradient.
  The learning-rate schedule moves once per inner step of a committed unit (after it).
- Non-finite values: a non-finite loss on any member (the vote) or a non-finite averaged
  pseudo-gradient discards the unit everywhere (``checks_gradients``).
- ``job.precision: fp16`` (``sync/scaler.py``): each inner step unscales this worker's gradients
  (``1/S``); an inner step whose scaled gradients are not finite is an overflow: this worker
  skips it and the rest of its unit's inner steps and votes ``OVERFLOW_CODE``, so the unit is
  discarded everywhere (not a non-finite unit) and every member settles its scale from the vote:
  the scale changes only at outer steps, from the agreed verdict, and stays equal everywhere.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from flotilla.cluster.launch_plan import LaunchNeeds
from flotilla.comm.collective import Group
from flotilla.core.errors import CollectiveError
from flotilla.sync.base import Outcome, Proposal, Regime, SyncStrategy, Traits
from flotilla.sync.buffers import ReplicaBuffers
from flotilla.sync.scaler import OVERFLOW_CODE, OVERFLOW_REASON, LossScaler, ScaleSlot
from flotilla.sync.spec import StrategyContext, StrategySpec, VotedSettings
from flotilla.sync.state import all_finite

__all__ = ["SPEC", "DiLoCo", "DiLoCoStrategy"]


class DiLoCoStrategy(VotedSettings):
    """DiLoCo / LocalSGD: ``inner_steps`` local steps, then an outer step on the averaged
    pseudo-gradient (defaults: DiLoCo's Nesterov outer SGD, lr 0.7, momentum 0.9)."""

    kind: Literal["diloco"] = "diloco"
    inner_steps: int = Field(default=20, ge=1, le=10**6)  # H
    outer_lr: float = Field(default=0.7, gt=0, le=100)
    outer_momentum: float = Field(default=0.9, ge=0, lt=1)
    nesterov: bool = True  # (no effect without momentum)


_REASONS = {
    1.0: "a replica failed during the unit",
    2.0: "non-finite loss or pseudo-gradient on a replica",
    OVERFLOW_CODE: OVERFLOW_REASON,
}


class DiLoCo(SyncStrategy):
    """One replica's DiLoCo (see the module doc)."""

    kind = "diloco"
    end_wait_s = 120.0  # (every member trained the same last step: any holds the final weights)

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        settings: DiLoCoStrategy,
    ) -> None:
        self.traits = Traits(regime=Regime.VOTE, steps_per_commit=settings.inner_steps, checks_gradients=True)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("model has no trainable parameters")
        self.inner = optimizer
        momentum = settings.outer_momentum
        self.outer = torch.optim.SGD(
            self.params, lr=settings.outer_lr, momentum=momentum, nesterov=settings.nesterov and momentum > 0
        )
        self.buffers = ReplicaBuffers(model)
        self._group: Group | None = None
        self._anchor: list[torch.Tensor] = []
        self._inner_saved: dict[str, Any] | None = None
        self._in_unit = False
        self.scale = ScaleSlot()  # job.precision fp16: this replica's loss scaler
        self._overflowed = False  # an inner step of this unit overflowed (fp16)
        self.step = 0
        self.outer_steps = 0
        self._pending_local: dict[str, torch.Tensor] = {}
        self._started = False

    def bind(self, group: Group | None) -> None:
        self._group = group

    # ------------------------------------------------------------------ the inner steps
    def begin_step(self, step: int) -> None:
        if self._group is None:
            raise CollectiveError("no group bound")
        if not self._in_unit:  # the unit's first minibatch: remember where it started
            self._in_unit = True
            with torch.no_grad():
                self._anchor = [p.detach().clone() for p in self.params]
            self._inner_saved = copy.deepcopy(self.inner.state_dict())
            self.buffers.save()
            self._overflowed = False
        self.inner.zero_grad(set_to_none=True)
        self.step = step

    def local_step(self) -> None:
        self._inner_step()

    def use_loss_scale(self, scaler: LossScaler | None) -> None:
        """``job.precision: fp16``: unscale every inner step's gradients and settle ``scaler``
        from the outer vote (module doc)."""
        self.scale.attach(scaler)

    def _inner_step(self) -> None:
        scaler = self.scale.scaler
        if scaler is not None:
            if self._overflowed or not scaler.unscale_([p.grad for p in self.params if p.grad is not None]):
                self._overflowed = True  # (this and the unit's later inner steps are skipped)
                return
        scale = float(self._group.world_size) if self._group is not None else 1.0
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif scale != 1.0:
                p.grad.mul_(scale)
        self.inner.step()

    # ------------------------------------------------------------------ the outer step
    def synchronize(self, proposal: Proposal = Proposal()) -> Outcome:
        self._in_unit = False
        group = self._group
        if group is None or group.aborted:
            self._discard()
            return Outcome.group_failed(f"group {group.abort_reason if group is not None else 'unbound'}")
        self._inner_step()
        with torch.no_grad():
            delta = torch.cat([(a - p).reshape(-1) for a, p in zip(self._anchor, self.params, strict=True)])
        try:
            if group.world_size > 1:
                handle = group.allreduce_async(delta)
                self.buffers.launch(group)
                handle.wait()
                self.buffers.wait()
            finite = proposal.local_ok and all_finite((delta,))
            code = 0.0 if finite else 2.0  # (1.0: a test's fault plan, through ``Group.vote``)
            if finite and self._overflowed:
                code = OVERFLOW_CODE
            vote = torch.tensor(
                [code, float(proposal.pending_epoch), float(proposal.stop), float(proposal.switch)],
                dtype=torch.float64,
            )
            group.vote(vote)  # (alone: the identity, but a test's fault plan may fail it)
        except CollectiveError as exc:
            self._discard()
            return Outcome.group_failed(str(exc))
        code_v, epoch_v, stop_v, switch_v = vote.tolist()
        self.scale.settle_code(code_v)
        committed = code_v == 0.0
        if committed:
            self._outer_step(delta, group.world_size)
        else:
            self._discard()
        return Outcome(
            committed=committed,
            pending_epoch=int(epoch_v),
            stop=stop_v > 0,
            switch=int(switch_v),
            local_ok=code_v < 2.0,
            reason="" if committed else _REASONS.get(code_v, _REASONS[1.0]),
        )

    def _outer_step(self, delta: torch.Tensor, world_size: int) -> None:
        delta.div_(world_size)
        offset = 0
        with torch.no_grad():
            for p, a in zip(self.params, self._anchor, strict=True):
                n = p.numel()
                p.copy_(a)
                p.grad = delta[offset : offset + n].view_as(p)
                offset += n
        if world_size > 1:
            self.buffers.apply(world_size)
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        self.outer_steps += 1

    def _discard(self) -> None:
        """Nothing of the unit stays: the weights, inner state and buffers of its start."""
        if self._anchor:
            with torch.no_grad():
                for p, a in zip(self.params, self._anchor, strict=True):
                    p.copy_(a)
        if self._inner_saved is not None:
            self.inner.load_state_dict(self._inner_saved)
        self.buffers.restore()
        for p in self.params:
            p.grad = None

    # ------------------------------------------------------------------ state and records
    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {"outer_steps": torch.tensor([self.outer_steps], dtype=torch.int64), **self.scale.state_dict()}
        for i, p in enumerate(self.params):
            buf = self.outer.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                out[f"momentum.{i}"] = buf
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        state = self.scale.load(state)
        unknown = set(state) - {"outer_steps"} - {f"momentum.{i}" for i in range(len(self.params))}
        if unknown:
            raise ValueError(f"diloco state: unknown entries {sorted(unknown)}")
        if "outer_steps" in state:
            self.outer_steps = int(state["outer_steps"].reshape(-1)[0])
        self.outer.state.clear()
        for i, p in enumerate(self.params):
            buf = state.get(f"momentum.{i}")
            if buf is None:
                continue
            if buf.shape != p.shape:
                raise ValueError(
                    f"diloco state: momentum.{i} has shape {tuple(buf.shape)}, expected {tuple(p.shape)}"
                )
            self.outer.state[p]["momentum_buffer"] = buf.detach().to(p.device, p.dtype).clone()

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """The inner optimizer's state, this worker's own (its tensors, ``inner.<param>.<slot>``)."""
        out = {}
        for idx, slots in self.inner.state_dict()["state"].items():
            for name, value in slots.items():
                if torch.is_tensor(value):
                    out[f"inner.{idx}.{name}"] = value
        return out

    def load_local_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Kept until :meth:`start`: the first view's agreement may still hand every member the
        donor's optimizer state, which this worker's own then replaces."""
        self._pending_local = dict(state)
        if self._started:
            self._apply_local()

    def start(self) -> None:
        self._started = True
        self._apply_local()

    def _apply_local(self) -> None:
        state, self._pending_local = self._pending_local, {}
        if not state:
            return
        sd = self.inner.state_dict()
        slots: dict[int, dict[str, Any]] = {int(i): dict(v) for i, v in sd["state"].items()}
        for key, value in state.items():
            prefix, idx, name = (key.split(".", 2) + ["", ""])[:3]
            if prefix != "inner" or not idx.isdigit() or not name:
                raise ValueError(f"diloco local state: unknown entry {key!r}")
            slots.setdefault(int(idx), {})[name] = value.clone()
        self.inner.load_state_dict({"state": slots, "param_groups": sd["param_groups"]})

    def record_fields(self) -> dict[str, Any]:
        return {"outer_steps": self.outer_steps}


def _build(
    model: nn.Module, optimizer: torch.optim.Optimizer, settings: Any, ctx: StrategyContext
) -> SyncStrategy:
    if not isinstance(settings, DiLoCoStrategy):
        raise TypeError(f"strategy diloco needs its settings (DiLoCoStrategy), got {type(settings).__name__}")
    return DiLoCo(model, optimizer, settings)


SPEC = StrategySpec(
    kind="diloco",
    settings=DiLoCoStrategy,
    build=_build,
    summary="DiLoCo / LocalSGD: H local steps, then an atomic outer step on the averaged pseudo-gradient",
    launch=LaunchNeeds(gpu=True, auto_checkpoint=True),
    simulated="flotilla.sim.vote:diloco_of",
)
