"""The update rule of one parameter-server shard: how a push changes the weights, the per-clock
momentum and weight decay, and the 1/N momentum shares (SPEC §1).  A mixin of
:class:`flotilla.ps.store.ShardStore` (which holds the versioned tensor table, validation and
the clock table); no I/O, threads or wall clock.

Invariants:
- Published weight tensors are **immutable**: every update builds new tensors (out of place) and
  swaps them in, so a pull reply can send them zero-copy while later pushes are applied, and a
  snapshot captures references, not copies.  Momentum buffers are replaced the same way.
- Server SGD is **one optimizer step per global clock** (SPEC §1's clock) on the sum of the
  clock's pushes (the global-batch gradient).  A push is applied at once: its gradient step
  (``w -= lr·g``; ``lr·(1+μ)·g`` with Nesterov) plus a 1/N share of the momentum step
  ``-lr·μ·m`` (``-lr·μ²·m`` with Nesterov) while fewer pushes than live workers arrived since the
  last fold (the first pushes of the interval take the shares, whichever workers sent them);
  ``g`` is summed into ``pending``.  When ``c_global`` advances the shard *folds* the clock: the
  shares not yet taken by live workers and weight decay (on the weights the clock started from)
  are applied, and ``m ← μ·m + pending``.  A jump of ``c_global`` by several clocks (a worker
  leaving, a resync after a restart) folds once.
- **N, the share divisor** (:meth:`ShardSGD.share_divisor`): the live workers plus the workers
  that *left* (``ps.leave``: e.g. finished early under SSP), never fewer than the job's workers
  minus those *evicted*.  So a worker that leaves no longer contributes its share (one momentum
  step per fold scaled by the fraction still in the job, as with worker-side momentum; taking
  the full step with one worker left made the final SSP accuracy of ``examples/ps_ssp.yaml`` drop
  by up to 0.05), while a worker declared dead (``evict``, whose data slices the survivors take
  over) or one joining mid-run does **not** change the momentum step: every fold takes the full
  step whatever the live count.  (Before issue 19's fix N stayed the job's workers after an
  eviction, so the momentum step, and with μ = 0.9 the effective learning rate ``lr·(1 + 9f)``,
  shrank to the live fraction f and jumped back when joiners restored the count: a 1.3-1.8x
  jump of the effective learning rate that made training diverge after the third
  kill-and-rejoin cycle of ``examples/ps_ssp.yaml``; ``tests/unit/test_ps_store.py``.)
- Under BSP a pull for clock c+1 therefore sees ``torch.optim.SGD`` after c+1 steps on the
  global-batch gradient (equal up to float rounding: the momentum step is added in N pieces).
  Under SSP/ASP pushes from workers ahead of ``c_global`` cannot multiply the momentum.
- With a learning-rate schedule (``ServerSGD.schedule``) every step size of a push tagged c, and
  of the fold of clock c, is scaled by ``schedule.factor(c)``.
"""

from __future__ import annotations

import torch

from flotilla.ps.clock_rules import ShardClocks
from flotilla.ps.config import DeltaUpdate, ServerSGD, ShardConfig

__all__ = ["ShardSGD"]


class ShardSGD:
    """The optimizer state of a shard's chunks (slot order) and the update rule (module doc).
    The host class sets ``config``, ``clocks`` and ``layout``."""

    config: ShardConfig
    clocks: ShardClocks
    layout: object | None

    def _init_sgd(self) -> None:
        self.weights: list[torch.Tensor] = []
        self.momentum: list[torch.Tensor | None] = []
        self.pending: list[torch.Tensor | None] = []  # sum of the gradients not yet folded
        self.start: list[torch.Tensor | None] = []  # weights at the last fold (weight decay)
        self.folded_clock = 0  # c_global at the last fold
        self.applied: list[int] = []  # pushes since the last fold (momentum shares)

    def _seed_sgd(self, weights: list[torch.Tensor]) -> None:
        self.weights = weights
        self.momentum = [None] * len(weights)
        self.pending = [None] * len(weights)
        self.applied = [0] * len(weights)
        self.start = self._starts()
        self.folded_clock = self.clocks.table.c_global

    def share_divisor(self) -> int:
        """N of the 1/N momentum shares (module doc)."""
        c = self.clocks
        live, left = len(c.table.entries), len(c.departed - c.evicted)
        return max(1, live + left, self.config.num_workers - len(c.evicted))

    def _apply(self, slot: int, g: torch.Tensor, clock: int) -> None:
        """The immediate part of a push of ``clock`` (module doc): its gradient step and its 1/N
        share of the clock's momentum step, at that clock's learning rate."""
        w = self.weights[slot]
        rule = self.config.update
        if isinstance(rule, DeltaUpdate):
            self.weights[slot] = torch.add(w, g)
            return
        scale = rule.scale_at(clock)
        w = torch.add(w, g, alpha=-rule.lr * rule.gradient_gain * scale)
        if rule.momentum:
            m = self.momentum[slot]
            if m is not None and self.applied[slot] < max(1, len(self.clocks.table.entries)):
                w = torch.add(w, m, alpha=-rule.momentum_lr * scale / self.share_divisor())
            self.applied[slot] += 1
            p = self.pending[slot]
            self.pending[slot] = g.clone() if p is None else torch.add(p, g)
        self.weights[slot] = w

    def _starts(self) -> list[torch.Tensor | None]:
        rule = self.config.update
        keep = isinstance(rule, ServerSGD) and rule.weight_decay > 0
        return list(self.weights) if keep else [None] * len(self.weights)

    def _fold_due(self) -> bool:
        """Whether ``c_global`` passed the last folded clock (a fold is due)."""
        c = self.clocks
        return self.layout is not None and c.complete and c.table.c_global > self.folded_clock

    def _fold(self) -> None:
        """Fold the finished global clock into the optimizer state (module doc); only when
        :meth:`_fold_due`."""
        folding, self.folded_clock = self.folded_clock, self.clocks.table.c_global
        rule = self.config.update
        if isinstance(rule, DeltaUpdate):
            return
        for slot in range(len(self.weights)):
            self._fold_slot(slot, rule, rule.scale_at(folding))
        self.start = self._starts()

    def _fold_slot(self, slot: int, rule: ServerSGD, scale: float) -> None:
        mu, w, g, start = rule.momentum, self.weights[slot], self.pending[slot], self.start[slot]
        if rule.weight_decay and start is not None:
            decay = torch.mul(start, rule.weight_decay)
            w = torch.add(w, decay, alpha=-rule.lr * rule.gradient_gain * scale)
            g = decay if g is None else torch.add(g, decay)
        if mu:
            m = self.momentum[slot]
            active = len(self.clocks.table.entries)
            if m is not None and self.applied[slot] < active:  # fewer pushes than live workers
                share = -rule.momentum_lr * scale * (active - self.applied[slot])
                w = torch.add(w, m, alpha=share / self.share_divisor())
            self.applied[slot] = 0
            if m is None:
                self.momentum[slot] = None if g is None else g.clone()
            else:
                self.momentum[slot] = torch.mul(m, mu) if g is None else torch.add(g, m, alpha=mu)
        self.weights[slot] = w
        self.pending[slot] = None
