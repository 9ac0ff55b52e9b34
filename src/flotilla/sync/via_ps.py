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

Cached reads (SSP with ``strategy.cached_reads``, Ho et al.'s client cache): weights pulled when
the shards' global clock was g contain every worker's pushes for clocks below g, so they satisfy
the SSP bound for every own clock k <= g + s.  ``push_pull(c)`` therefore skips the pull while
``min(read_c_global) >= c + 1 - s``: it sends the push asynchronously (acknowledged before the
next call) and applies the worker's own update locally ("read my writes": ``w -= lr·g``, exactly
the server's immediate part of a push; momentum and weight decay arrive with the next pull;
in delta mode the local weights already hold it).  BSP (s = 0) can never skip; ASP, which has no
bound, pulls every clock so a worker keeps seeing the others' progress.

Read-ahead (``strategy.read_ahead``; SSP with s >= 1, or ASP): the pull for clock c + 1 is
issued together with the push of clock c - 1, *before* computing clock c, so it travels while the
worker computes (Ho et al.'s SSP lets a worker at clock k use weights with every update of clocks
below k - s; BSP cannot do this, its pull for k needs the worker's own push of k - 1).  Per clock,
``push_pull(c)`` waits for that reply (usually already there), loads it, applies the worker's own
clock-c update locally (read my writes, as with cached reads: ``w -= lr·g`` / ``w += delta``), and
starts ``[push c, pull c + 2]`` on every shard.  Every clock therefore pulls, one clock earlier,
and the gate still checks the bound: ``read_c_global >= k - s`` for the weights of clock k.
A ``push_pull`` with nothing usable in flight (clock 0, or after ``push``, ``pull`` or
``refresh``, which collect the request in flight and drop its reply) pulls for the next clock
synchronously first.

Invariants: only trainable parameters are PS keys (buffers stay local); after ``pull`` the
model's parameters equal the global ones bitwise; ``push(c)`` must follow ``pull(c)`` (or
``initialize`` for c = 0) and clocks go up by one; the weights used for clock k always include
every worker's updates for clocks < ``read_c_global`` (reported per clock) and
``read_c_global >= k - s`` under SSP.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from flotilla.config.schema import AdamOptimizer, PSStrategy, SGDOptimizer
from flotilla.core.errors import CommError, ConfigError
from flotilla.core.log import get_logger
from flotilla.ps.client import ClientOptions, PSClient, keys_of
from flotilla.ps.consistency import max_pull_ahead
from flotilla.ps.store import consistency_of

__all__ = ["PSSync", "build_local_optimizer"]

log = get_logger("sync.via_ps")


def build_local_optimizer(cfg: Any, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """The job's optimizer over ``params`` (SGD or Adam), for ``update: delta``."""
    if isinstance(cfg, SGDOptimizer):
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=cfg.nesterov
        )
    if isinstance(cfg, AdamOptimizer):
        return torch.optim.Adam(
            params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    raise ConfigError(f"job.optimizer.kind must be sgd or adam, got {getattr(cfg, 'kind', cfg)!r}")


class PSSync:
    """A worker's view of the PS for one model (see the module doc for the loop)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer_cfg: Any,
        strategy: PSStrategy,
        server_addresses: Sequence[str],
        secret: bytes,
        worker_id: int,
        *,
        num_workers: int,
        optimizer: torch.optim.Optimizer | None = None,
        options: ClientOptions | None = None,
    ) -> None:
        if len(server_addresses) != strategy.num_servers:
            raise ConfigError(
                f"strategy.num_servers is {strategy.num_servers} but "
                f"{len(server_addresses)} server addresses were given"
            )
        self.strategy = strategy
        self.num_workers = num_workers
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not self.params:
            raise ConfigError("model has no trainable parameters to keep on the parameter server")
        self.wave_size = strategy.s_local + 1 if strategy.consistency == "wsp" else 1
        if self.wave_size > 1 and strategy.update != "delta":
            raise ConfigError(
                "strategy.update must be 'delta' when consistency is 'wsp' with "
                f"s_local > 0 (got {strategy.update!r})"
            )
        self.optimizer: torch.optim.Optimizer | None = None
        self._base: dict[str, torch.Tensor] = {}
        if strategy.update == "delta":
            self.optimizer = optimizer or build_local_optimizer(optimizer_cfg, list(self.params.values()))
            self._base = {
                n: torch.empty_like(p, memory_format=torch.contiguous_format) for n, p in self.params.items()
            }
        elif not isinstance(optimizer_cfg, SGDOptimizer):
            raise ConfigError(
                "strategy.update: 'server_sgd' needs job.optimizer.kind 'sgd'; "
                "use update: delta for other optimizers"
            )
        opts = options or ClientOptions(
            pull_timeout_s=strategy.pull_timeout_s, attempt_timeout_s=min(5.0, strategy.pull_timeout_s)
        )
        self.client = PSClient(
            server_addresses,
            secret,
            worker_id=worker_id,
            keys=keys_of(self.params),
            chunk_bytes=strategy.chunk_bytes,
            options=opts,
        )
        self.client.reseed = self._values
        self._zeros: dict[str, torch.Tensor] = {}
        self.cached_reads = strategy.consistency == "ssp" and strategy.cached_reads
        self._own_lr = 0.0
        if self.optimizer is None:  # server_sgd: the server's immediate step size
            gain = 1.0 + optimizer_cfg.momentum if optimizer_cfg.nesterov else 1.0
            self._own_lr = optimizer_cfg.lr * gain
        self.pulled = True  # whether the last push_pull pulled
        self.read_ahead = strategy.read_ahead and max_pull_ahead(consistency_of(strategy)) > 0
        if strategy.read_ahead and not self.read_ahead:
            log.info(
                "strategy.read_ahead has no effect under %s (needs ssp with staleness >= 1, or asp)",
                strategy.consistency,
            )
        if self.read_ahead and worker_id == 0:
            log.warning(
                "strategy.read_ahead: every read is up to one clock staler (the pull for "
                "clock c + 1 leaves before clock c is computed); at a learning rate and "
                "momentum tuned for BSP this can keep training from converging (measured: "
                "docs/ps.md, 'Read-ahead'; try benchmarks/ps_staleness.py)"
            )
        self._staging: dict[str, torch.Tensor] = {}
        if self.read_ahead:  # where the pull in flight lands
            self._staging = {
                n: torch.empty_like(p, memory_format=torch.contiguous_format) for n, p in self.params.items()
            }
        self._ahead_inflight = False  # a [push, pull ahead] request is in flight
        self._held_c_global = 0  # read_c_global of the weights in the model

    @property
    def read_c_global(self) -> int:
        """Lower bound of the global clock of the weights held (see the module doc)."""
        return self._held_c_global

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
        self.client.pull(clock, self._data())
        self._held_c_global = min(self.client.read_c_global)
        self._ahead_inflight = False  # (read-ahead) the reply in flight is not used
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
        self._ahead_inflight = False
        self._consume_grads()

    def push_pull(self, clock: int) -> bool:
        """``push(clock)`` then ``pull(clock + 1)`` in one round trip per shard, or, with cached
        reads and weights still within the SSP bound, an asynchronous push and a local update
        (module doc).  Returns whether it pulled."""
        if self.read_ahead:
            return self._push_pull_ahead(clock)
        if self.cached_reads and self.read_c_global >= clock + 1 - self.strategy.staleness:
            update = self._update()
            self.client.push_async(update, clock)
            if self.optimizer is None:  # (delta: the local weights already hold it)
                self._add_own(update)
            self._consume_grads()  # the request still holds the gradient tensors
            self._rebase()
            self.pulled = False
            return False
        self.client.push_pull(self._update(), clock, self._data())
        self._held_c_global = min(self.client.read_c_global)
        self._consume_grads()
        self._rebase()
        self.pulled = True
        return True

    def _push_pull_ahead(self, clock: int) -> bool:
        """Read-ahead ``push_pull`` (module doc): load the weights for ``clock + 1`` pulled while
        this clock computed, add this clock's own update, start ``[push clock, pull clock + 2]``."""
        update = self._update()
        if self._ahead_inflight:
            self.client.wait_pushes()  # the staging tensors now hold the reply
        else:  # clock 0 (nothing in flight yet)
            self.client.pull(clock + 1, self._staging)
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self._staging[n])
        self._add_own(update)
        self._held_c_global = min(self.client.read_c_global)
        self.client.push_pull_ahead(update, clock, self._staging)
        self._ahead_inflight = True
        self._consume_grads()  # the request still holds the gradient tensors
        self._rebase()
        self.pulled = True
        return True

    def _add_own(self, update: dict[str, torch.Tensor]) -> None:
        """Read my writes: add this worker's own update to the model's weights, as the server
        applies it at once (``w -= lr·g``; in delta mode ``w += delta``)."""
        with torch.no_grad():
            for n, p in self.params.items():
                if self.optimizer is None:
                    p.add_(update[n], alpha=-self._own_lr)
                else:
                    p.add_(update[n])

    def pull_final(
        self, clock: int, *, poll_s: float = 0.05, stop: Callable[[], bool] = lambda: False
    ) -> bool:
        """Wait until every worker has pushed ``clock`` clocks (or left), then pull: the job's
        final global weights, whatever the consistency model.  Fails only if the shards' global
        clock makes no progress for ``strategy.pull_timeout_s``; returns False without pulling
        if ``stop()`` becomes true meanwhile."""
        self.client.wait_pushes()
        limit = self.strategy.pull_timeout_s
        progress, deadline = -1, time.monotonic() + limit
        while True:
            clocks = [st["c_global"] for st in self.client.stats()]
            if min(clocks) >= clock:
                break
            if stop():
                return False
            if min(clocks) > progress:
                progress, deadline = min(clocks), time.monotonic() + limit
            elif time.monotonic() > deadline:
                raise CommError(
                    f"final pull: the shards' global clocks {clocks} made no progress "
                    f"towards {clock} for pull_timeout_s={limit} s"
                )
            time.sleep(poll_s)
        self.pull(clock)
        self.pulled = True
        return True

    def refresh(self, clock: int) -> None:
        """Pull the current global weights for ``clock`` (the number of pushes made) if the model
        does not hold them (the last ``push_pull`` served from the cache, or read-ahead); e.g.
        before evaluating them."""
        if not self.pulled or self.read_ahead:
            self.pull(clock)
            self.pulled = True

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
