"""A PS worker's exchanges with the shards: ``sync/via_ps.PSSync``'s half that moves weights
(push, pull, the two in one round trip, the final pull), inherited by it.

Cached reads (SSP with ``read_mode: cached``, Ho et al.'s client cache): weights pulled when
the shards' global clock was g contain every worker's pushes for clocks below g, so they satisfy
the SSP bound for every own clock k <= g + s.  ``push_pull(c)`` therefore skips the pull while
``min(read_c_global) >= c + 1 - s``: it sends the push asynchronously (acknowledged before the
next call) and applies the worker's own update locally ("read my writes": ``w -= lr·g``, exactly
the server's immediate part of a push; momentum and weight decay arrive with the next pull;
in delta mode the local weights already hold it).  BSP (s = 0) can never skip; ASP, which has no
bound, pulls every clock so a worker keeps seeing the others' progress.

Read-ahead (``read_mode: read_ahead``; SSP with s >= 1, or ASP): the pull for clock c + 1 is
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

On a GPU the pushes and pulls go through pinned host buffers with asynchronous copies
(``sync/ps_staging.HostStaging``): a push's tensors are copied to the host on a side stream when
the unit is synchronised (with ``copy_in_backward``, off by default, each ``server_sgd`` gradient
as the last backward pass finishes it); a pulled value is copied into its parameter on the current
stream, ahead of the next forward pass.  The pushes themselves
keep their schedule: a plain ``push_pull`` is one synchronous round trip under every model (the
next forward reads what it pulls); cached reads and read-ahead push from the client's threads
while the next clock computes (at most one push in flight, acknowledged before the next call).

The decisions (skip the pull? which clock does a pull ask for? what bound do the held weights
satisfy?) are the pure rules of ``ps/read_rules.py``; this module executes them.

Invariants: after ``pull`` the model's parameters equal the global ones bitwise; ``push(c)``
must follow ``pull(c)`` (or ``initialize`` for c = 0) and clocks go up by one; the weights used
for clock k always include every worker's updates for clocks < ``read_c_global`` and
``read_c_global >= k - s`` under SSP.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from flotilla.core.errors import CommError
from flotilla.ps.client import PSClient
from flotilla.ps.config import PSConfig
from flotilla.ps.read_rules import all_pushed, held_c_global, read_plan
from flotilla.sync.ps_staging import HostStaging
from flotilla.sync.ps_update import WorkerUpdate

__all__ = ["PSExchange"]


class PSExchange:
    """Push and pull through ``client`` (module doc), with the attributes ``sync/via_ps.PSSync``
    sets: the client, the host staging, the worker's updates, the read mode and what the weights
    held satisfy."""

    ps: PSConfig
    client: PSClient
    staging: HostStaging
    updates: WorkerUpdate
    optimizer: torch.optim.Optimizer | None
    read_ahead: bool
    pulled: bool  # whether the last push_pull pulled
    _mode: str  # the effective read mode: plain, cached, read_ahead
    _staleness: int  # SSP's s (0 for the other models)
    _ahead_inflight: bool  # a [push, pull ahead] request is in flight
    _held_c_global: int  # read_c_global of the weights in the model

    @property
    def read_c_global(self) -> int:
        """Lower bound of the global clock of the weights held (see the module doc)."""
        return self._held_c_global

    def pull(self, clock: int) -> None:
        """Block until the gate allows ``clock``; then the model holds the global parameters."""
        self.client.pull(clock, self.staging.target())
        self.staging.load()
        self._held_c_global = held_c_global(self.client.read_c_global)
        self._ahead_inflight = False  # (read-ahead) the reply in flight is not used
        self.updates.rebase()

    def local_step(self) -> None:
        """Delta mode: apply the local optimizer (a minibatch inside a WSP wave), no push."""
        self.updates.local_step()

    def push(self, clock: int) -> None:
        """Send this clock's update: gradients (server_sgd) or ``w - w_pulled`` (delta).
        The gradients are consumed (set to None) either way."""
        self.client.push(self.staging.to_host(self.updates.make()), clock)
        self._ahead_inflight = False
        self.updates.consume_grads()

    def push_pull(self, clock: int) -> bool:
        """``push(clock)`` then ``pull(clock + 1)`` in one round trip per shard, or, with cached
        reads and weights still within the SSP bound, an asynchronous push and a local update
        (module doc).  Returns whether it pulled."""
        plan = read_plan(
            self._mode,
            clock=clock,
            held=self._held_c_global,
            staleness=self._staleness,
            ahead_in_flight=self._ahead_inflight,
        )
        if plan.kind == "ahead":
            return self._push_pull_ahead(clock, plan.sync_pull)
        if plan.kind == "push_only":
            update = self.updates.make()
            self.client.push_async(self.staging.to_host(update), clock)
            if self.optimizer is None:  # (delta: the local weights already hold it)
                self.updates.add_own(update, clock)
            self.updates.consume_grads()  # the request still holds the gradient tensors
            self.updates.rebase()
            self.pulled = False
            return False
        self.client.push_pull(self.staging.to_host(self.updates.make()), clock, self.staging.target())
        self.staging.load()
        self._held_c_global = held_c_global(self.client.read_c_global)
        self.updates.consume_grads()
        self.updates.rebase()
        self.pulled = True
        return True

    def _push_pull_ahead(self, clock: int, sync_pull: int | None) -> bool:
        """Read-ahead ``push_pull`` (module doc): load the weights for ``clock + 1`` pulled while
        this clock computed, add this clock's own update, start ``[push clock, pull clock + 2]``."""
        update = self.updates.make()
        host = self.staging.to_host(update)
        if sync_pull is None:
            self.client.wait_pushes()  # the "ahead" target now holds the reply
        else:  # clock 0 (nothing in flight yet)
            self.client.pull(sync_pull, self.staging.target("ahead"))
        self.staging.load("ahead")
        self.updates.add_own(update, clock)
        self._held_c_global = held_c_global(self.client.read_c_global)
        self.client.push_pull_ahead(host, clock, self.staging.target("ahead"))
        self._ahead_inflight = True
        self.updates.consume_grads()  # the request still holds the gradient tensors
        self.updates.rebase()
        self.pulled = True
        return True

    def pull_final(
        self, clock: int, *, poll_s: float = 0.05, stop: Callable[[], bool] = lambda: False
    ) -> bool:
        """Wait until every worker has pushed ``clock`` clocks (or left), then pull: the job's
        final global weights, whatever the consistency model.  Fails only if the shards' global
        clock makes no progress for ``pull_timeout_s``; returns False without pulling
        if ``stop()`` becomes true meanwhile."""
        self.client.wait_pushes()
        limit = self.ps.pull_timeout_s
        progress, deadline = -1, time.monotonic() + limit
        while True:
            clocks = [st["c_global"] for st in self.client.stats()]
            if all_pushed(clocks, clock):
                break
            if stop():
                return False
            if self.client.gone is not None:
                for s in range(self.client.num_shards):
                    self.client.evict_gone(s, time.monotonic() + limit)
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
