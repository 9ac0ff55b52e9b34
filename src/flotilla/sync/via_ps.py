"""Strategy ``ps``: data parallelism through the sharded parameter server (SPEC §1, §2).

A worker's loop, per clock ``c`` (a step; a wave of ``wave_size`` steps under WSP)::

    sync.initialize()                       # once: seed the servers (first worker wins), pull 0
    for c in range(num_clocks):
        for i in range(sync.wave_size):     # 1 unless WSP with s_local > 0
            optimizer-free forward/backward on a minibatch (loss = sum / global_batch)
            if i < sync.wave_size - 1:
                sync.local_step()           # delta mode: apply the local optimizer only
        sync.push(c)                        # send the update tagged c
        sync.pull(c + 1)                    # block per the consistency gate, load global weights
        # or, equivalently, in one round trip per shard: sync.push_pull(c)

Update rules (``strategy.update``):
- ``server_sgd``: ``push`` sends each parameter's ``.grad`` (None counts as zeros) and the server
  applies SGD with the job's lr/momentum/weight decay/nesterov.  The worker must not step a local
  optimizer.  Losses scaled by ``1 / global_batch`` (as in ``allreduce``) make the pushes of one
  clock sum to the global-batch gradient.
- ``delta``: a local optimizer (the job's, built here unless one is passed) is stepped by ``push``
  (and ``local_step``), and ``push`` sends ``w_now - w_pulled``; the server adds it (``w += u``).
  Required by WSP with ``s_local > 0``: a wave's local updates are pushed once, summed.

Invariants: only trainable parameters are PS keys (buffers stay local); after ``pull`` the
model's parameters equal the global ones bitwise; ``push(c)`` must follow ``pull(c)`` (or
``initialize`` for c = 0) and clocks go up by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from flotilla.config.schema import AdamOptimizer, PSStrategy, SGDOptimizer
from flotilla.core.errors import CommError, ConfigError
from flotilla.core.log import get_logger
from flotilla.ps.client import ClientOptions, PSClient, keys_of

__all__ = ["PSSync", "build_local_optimizer"]

log = get_logger("sync.via_ps")


def build_local_optimizer(cfg: Any, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """The job's optimizer over ``params`` (SGD or Adam), for ``update: delta``."""
    if isinstance(cfg, SGDOptimizer):
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay, nesterov=cfg.nesterov)
    if isinstance(cfg, AdamOptimizer):
        return torch.optim.Adam(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                weight_decay=cfg.weight_decay)
    raise ConfigError(f"job.optimizer.kind must be sgd or adam, got {getattr(cfg, 'kind', cfg)!r}")


class PSSync:
    """A worker's view of the PS for one model (see the module doc for the loop)."""

    def __init__(self, model: nn.Module, optimizer_cfg: Any, strategy: PSStrategy,
                 server_addresses: Sequence[str], secret: bytes, worker_id: int, *,
                 num_workers: int, optimizer: torch.optim.Optimizer | None = None,
                 options: ClientOptions | None = None) -> None:
        if len(server_addresses) != strategy.num_servers:
            raise ConfigError(f"strategy.num_servers is {strategy.num_servers} but "
                              f"{len(server_addresses)} server addresses were given")
        self.strategy = strategy
        self.num_workers = num_workers
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not self.params:
            raise ConfigError("model has no trainable parameters to keep on the parameter server")
        self.wave_size = strategy.s_local + 1 if strategy.consistency == "wsp" else 1
        if self.wave_size > 1 and strategy.update != "delta":
            raise ConfigError("strategy.update must be 'delta' when consistency is 'wsp' with "
                              f"s_local > 0 (got {strategy.update!r})")
        self.optimizer: torch.optim.Optimizer | None = None
        self._base: dict[str, torch.Tensor] = {}
        if strategy.update == "delta":
            self.optimizer = optimizer or build_local_optimizer(optimizer_cfg, list(self.params.values()))
            self._base = {n: torch.empty_like(p, memory_format=torch.contiguous_format)
                          for n, p in self.params.items()}
        elif not isinstance(optimizer_cfg, SGDOptimizer):
            raise ConfigError("strategy.update: 'server_sgd' needs job.optimizer.kind 'sgd'; "
                              "use update: delta for other optimizers")
        opts = options or ClientOptions(pull_timeout_s=strategy.pull_timeout_s,
                                        attempt_timeout_s=min(5.0, strategy.pull_timeout_s))
        self.client = PSClient(server_addresses, secret, worker_id=worker_id,
                               keys=keys_of(self.params), chunk_bytes=strategy.chunk_bytes,
                               options=opts)
        self.client.reseed = self._values
        self._zeros: dict[str, torch.Tensor] = {}
        self.last_versions: list[int] = []

    def _values(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.params.items()}

    def initialize(self) -> None:
        """Register, seed the servers with this model's parameters unless another worker did
        (idempotent), and pull the global initial parameters."""
        self.client.hello(0)
        self.client.initialize(self._values())
        self.pull(0)

    def pull(self, clock: int) -> None:
        """Block until the gate allows ``clock``; then the model holds the global parameters."""
        self.last_versions = self.client.pull(clock, self._data())
        self._rebase()

    def local_step(self) -> None:
        """Delta mode: apply the local optimizer (a minibatch inside a WSP wave), no push."""
        if self.optimizer is None:
            raise ConfigError("local_step() needs strategy.update: delta")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def push(self, clock: int) -> None:
        """Send this clock's update: gradients (server_sgd) or ``w - w_pulled`` (delta).
        The gradients are consumed (set to None) either way."""
        self.client.push(self._update(), clock)
        self._consume_grads()

    def push_pull(self, clock: int) -> None:
        """``push(clock)`` then ``pull(clock + 1)`` in one round trip per shard."""
        self.last_versions = self.client.push_pull(self._update(), clock, self._data())
        self._consume_grads()
        self._rebase()

    def _update(self) -> dict[str, torch.Tensor]:
        if self.optimizer is None:
            return {n: self._grad(n, p) for n, p in self.params.items()}
        self.local_step()
        with torch.no_grad():
            return {n: p.detach() - self._base[n] for n, p in self.params.items()}

    def _data(self) -> dict[str, torch.Tensor]:
        return {n: p.data for n, p in self.params.items()}

    def _rebase(self) -> None:
        if self._base:
            with torch.no_grad():
                for n, p in self.params.items():
                    self._base[n].copy_(p)

    def _consume_grads(self) -> None:
        for p in self.params.values():
            p.grad = None

    def _grad(self, name: str, p: nn.Parameter) -> torch.Tensor:
        if p.grad is not None:
            return p.grad
        if name not in self._zeros:
            self._zeros[name] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return self._zeros[name]

    def close(self, *, leave: bool = True) -> None:
        """Leave the job (so gated peers stop waiting for us) and close the connections."""
        try:
            if leave:
                self.client.leave()
        except CommError as exc:
            log.warning("leaving the parameter server failed: %s", exc)
        finally:
            self.client.close()
