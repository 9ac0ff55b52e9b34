"""A PS worker's update rule (``PSConfig.update``): what ``sync/via_ps.PSSync`` pushes for a clock
and what it applies to its own weights.

- ``server_sgd``: the update is each parameter's ``.grad`` (None counts as zeros) and the server
  applies SGD with the job's lr/momentum/weight decay/nesterov.  The worker must not step a local
  optimizer.  Losses scaled by ``1 / global_batch`` (as in ``allreduce``) make the pushes of one
  clock sum to the global-batch gradient.
- ``delta``: a local optimizer (the worker's) is stepped (``make`` and ``local_step``) on the
  gradients times N (N = ``num_workers``, the job's workers: the loss was scaled by
  ``1/global_batch``, so N·g is the worker's local mean gradient when the batch splits evenly),
  and the update is ``u = (w_now - w_pulled) / N``; the server adds it (``w += u``).  A clock
  therefore moves the global weights by the mean of the workers' updates: one step's worth, as
  under ``allreduce`` at the same learning rate (exactly ``torch.optim.SGD`` on the global-batch
  gradient under BSP with SGD; ``ps/config.DeltaUpdate``).  After ``make`` the local weights are
  ``w_pulled + u`` (what the server holds of this worker's update).  Required by WSP with
  ``s_local > 0``: a wave's local updates (full steps on the local weights) are pushed once,
  summed and divided by N.

``add_own`` is "read my writes": the part of a push the server applies at once (``w -= lr_c·g`` at
the clock's learning rate; in delta mode nothing, the local weights already hold it).

Invariants: ``rebase`` must follow every change of the weights from outside (a pull), so that
``w_pulled`` is the base of the next delta; the gradients are consumed (set to None) after every
push (``consume_grads``); only trainable parameters (the PS keys) are handled.
"""

from __future__ import annotations

import torch
from torch import nn

from flotilla.core.errors import ConfigError
from flotilla.ps.config import DeltaUpdate, PSConfig, ServerSGD

__all__ = ["WorkerUpdate"]


class WorkerUpdate:
    """The update rule of one worker's trainable ``params`` (see the module doc).  ``optimizer`` is
    required for ``DeltaUpdate`` and unused (``self.optimizer`` None) with ``ServerSGD``."""

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        ps: PSConfig,
        *,
        num_workers: int,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        self.params, self.rule, self.num_workers = params, ps.update, num_workers
        self.optimizer: torch.optim.Optimizer | None = None
        self._base: dict[str, torch.Tensor] = {}
        if isinstance(ps.update, DeltaUpdate):
            if optimizer is None:
                raise ConfigError("PSSync: update 'delta' needs the worker's optimizer (optimizer=...)")
            self.optimizer = optimizer
            self._base = {
                n: torch.empty_like(p, memory_format=torch.contiguous_format) for n, p in self.params.items()
            }
        self._zeros: dict[str, torch.Tensor] = {}

    def local_step(self) -> None:
        """Delta mode: apply the local optimizer (a minibatch inside a WSP wave), no push."""
        if self.optimizer is None:
            raise ConfigError("local_step() needs strategy.update: delta")
        if self.num_workers > 1:  # the gradient of this worker's share -> its local mean gradient
            for p in self.params.values():
                if p.grad is not None:
                    p.grad.mul_(self.num_workers)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def make(self) -> dict[str, torch.Tensor]:
        """This clock's update: the gradients (server_sgd), or step and return ``u`` (delta)."""
        if self.optimizer is None:
            return {n: self._grad(n, p) for n, p in self.params.items()}
        self.local_step()
        n_workers = self.num_workers
        with torch.no_grad():
            update = {n: p.detach() - self._base[n] for n, p in self.params.items()}
            if n_workers > 1:  # push the mean's share; hold what the server will hold of it
                for n, p in self.params.items():
                    update[n].div_(n_workers)
                    p.copy_(self._base[n]).add_(update[n])
        return update

    def add_own(self, update: dict[str, torch.Tensor], clock: int) -> None:
        """Read my writes: add this worker's own update of ``clock`` to the model's weights, as
        the server applies it at once (``w -= lr_c·g`` at that clock's learning rate; in delta
        mode ``w += u``)."""
        rule = self.rule
        own_lr = rule.lr * rule.gradient_gain * rule.scale_at(clock) if isinstance(rule, ServerSGD) else 0.0
        with torch.no_grad():
            for n, p in self.params.items():
                if self.optimizer is None:
                    p.add_(update[n], alpha=-own_lr)
                else:
                    p.add_(update[n])

    def rebase(self) -> None:
        """Delta mode: the weights now held are ``w_pulled``, the base of the next update."""
        if self._base:
            with torch.no_grad():
                for n, p in self.params.items():
                    self._base[n].copy_(p)

    def consume_grads(self) -> None:
        for p in self.params.values():
            p.grad = None

    def _grad(self, name: str, p: nn.Parameter) -> torch.Tensor:
        if p.grad is not None:
            return p.grad
        if name not in self._zeros:
            self._zeros[name] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return self._zeros[name]
