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

Update rules (``PSConfig.update``; the config comes from the spec's ``package``, ``sync/ps_settings.py``):
``server_sgd`` pushes the gradients and the server applies SGD; ``delta`` steps the worker's
local optimizer and pushes ``(w_now - w_pulled) / N``.  What a push sends and what the worker
applies to its own weights is ``sync/ps_update.WorkerUpdate``; this module drives the client.

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

Invariants: only trainable parameters are PS keys (buffers stay local); after ``pull`` the
model's parameters equal the global ones bitwise; ``push(c)`` must follow ``pull(c)`` (or
``initialize`` for c = 0) and clocks go up by one; the weights used for clock k always include
every worker's updates for clocks < ``read_c_global`` (reported per clock) and
``read_c_global >= k - s`` under SSP.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Literal

import torch
from torch import nn

from flotilla.core.errors import CommError, ConfigError, FlotillaError
from flotilla.core.log import get_logger
from flotilla.ps.client import ClientOptions, PSClient, keys_of
from flotilla.ps.config import PSConfig
from flotilla.ps.consistency import SSP
from flotilla.ps.data_views import split_of
from flotilla.ps.read_rules import all_pushed, held_c_global, read_mode_notes, read_plan
from flotilla.sync.base import Outcome, Proposal, Regime, SyncStrategy, Traits
from flotilla.sync.ps_staging import Copies, HostStaging
from flotilla.sync.ps_update import WorkerUpdate

__all__ = ["PSSync"]

log = get_logger("sync.via_ps")
GONE_CHECK_S = 1.0  # a parked pull is re-issued (and the dead evicted) at least this often


class PSSync(SyncStrategy):
    """A worker's view of the PS for one model (see the module doc for the loop).

    As a :class:`SyncStrategy` (non-collective; a commit unit is one clock of ``wave_size``
    minibatches): ``start`` = ``initialize``, ``synchronize`` = ``push_pull`` of the next clock,
    ``before_eval`` = ``refresh``, ``finalize`` = ``pull_final``.  ``optimizer`` is required for
    ``DeltaUpdate`` (the worker's local optimizer) and unused with ``ServerSGD``.  ``host_copies``:
    how pushes and pulls are staged on the host (``sync/ps_staging.py``; ``"auto"``: pinned
    buffers on CUDA, else the pass-through; None: the pass-through); ``copy_in_backward``: with
    ``ServerSGD``, copy each gradient as backward finishes it (only where nothing changes the
    gradients between backward and ``synchronize``: not with an fp16 loss scaler)."""

    kind = "ps"

    def __init__(
        self,
        model: nn.Module,
        ps: PSConfig,
        server_addresses: Sequence[str],
        secret: bytes,
        worker_id: int,
        *,
        num_workers: int,
        optimizer: torch.optim.Optimizer | None = None,
        options: ClientOptions | None = None,
        gone: Callable[[], Collection[int]] | None = None,
        members: Sequence[int] = (),
        host_copies: Copies | None | Literal["auto"] = "auto",
        copy_in_backward: bool = False,
    ) -> None:
        if len(server_addresses) != ps.num_servers:
            raise ConfigError(
                f"strategy.num_servers is {ps.num_servers} but "
                f"{len(server_addresses)} server addresses were given"
            )
        self.ps = ps
        self.num_workers = num_workers
        self.first_members = tuple(sorted(members))  # the job's first view (data_split)
        self.data_view_start = -1  # first clock of the data view of the last unit (-1: the first)
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not self.params:
            raise ConfigError("model has no trainable parameters to keep on the parameter server")
        self.wave_size = ps.wave_size
        # elastic: a worker follows the coordinator's views on its own (no barrier), so its data
        # shard follows the live members; the shards learn of the dead through ``gone``
        self.traits = Traits(regime=Regime.ALONE, steps_per_commit=self.wave_size, nominal_batch=True)
        self.updates = WorkerUpdate(self.params, ps, num_workers=num_workers, optimizer=optimizer)
        self.optimizer = self.updates.optimizer
        opts = options or ClientOptions(
            pull_timeout_s=ps.pull_timeout_s, attempt_timeout_s=min(5.0, ps.pull_timeout_s)
        )
        self.client = PSClient(
            server_addresses,
            secret,
            worker_id=worker_id,
            keys=keys_of(self.params),
            chunk_bytes=ps.chunk_bytes,
            options=opts,
        )
        self.client.reseed = self._values
        if gone is not None:  # membership: evict workers declared dead while a pull waits on them
            self.client.gone = gone
            self.client.park_s = min(self.client.park_s, GONE_CHECK_S)
        self._mode = ps.effective_read_mode  # (one string, from the YAML's choice to the read rule)
        self.cached_reads, self.read_ahead = self._mode == "cached", self._mode == "read_ahead"
        self._staleness = ps.consistency.staleness if isinstance(ps.consistency, SSP) else 0
        self.pulled = True  # whether the last push_pull pulled
        kind = type(ps.consistency).__name__.lower()
        for level, line in read_mode_notes(
            ps.read_mode, kind, read_ahead=self.read_ahead, worker_id=worker_id
        ):
            getattr(log, level)("%s", line)
        # pushes and pulls through pinned host buffers on a GPU; a pass-through elsewhere
        self.staging = HostStaging(
            self.params,
            busy=lambda: self.client.push_in_flight,
            copies=host_copies,
            hooks=copy_in_backward and self.optimizer is None,  # (server_sgd: the gradient)
        )
        if self.staging.copies is not None:
            kind = "pinned" if self.staging.copies.pinned else "unpinned"
            log.info("worker %d: PS pushes and pulls staged through %s host buffers", worker_id, kind)
        self._ahead_inflight = False  # a [push, pull ahead] request is in flight
        self._held_c_global = 0  # read_c_global of the weights in the model
        self.clock = 0  # clocks pushed through synchronize()
        self.start_step = 0  # the step (clock x wave_size) it joined at (> 0: joined mid-run)
        self.pull_wait_s = 0.0  # duration of the last synchronize()
        self._closed = False
        self._finished = False  # trained its last clock: its leave drops no data

    # ------------------------------------------------------------------ SyncStrategy
    def start(self) -> None:
        self.initialize()

    def joined_at(self) -> int:
        return self.start_step

    def begin_step(self, step: int) -> None:
        """The gradients were consumed by the last push (or ``local_step``); on a GPU, pick the
        host buffers this unit's gradients are copied to as backward finishes them."""
        self.staging.arm()

    def defer_reduction(self, defer: bool) -> None:
        self.staging.defer(defer)

    def synchronize(self, proposal: Proposal = Proposal()) -> Outcome:
        """``push_pull`` of the next clock (``pending_epoch``: the loop moves to newer views alone).
        A unit with a non-finite loss or gradient (``proposal.local_ok`` False) is not pushed."""
        if not proposal.local_ok:
            return Outcome.agreed_alone(proposal, committed=False)
        t0 = time.perf_counter()
        self.push_pull(self.clock)
        self.pull_wait_s = time.perf_counter() - t0
        self.clock += 1
        return Outcome.agreed_alone(proposal)

    def mark_finished(self) -> None:
        self._finished = True

    def data_split(self) -> tuple[int, int] | None:
        """The rank and world size that split clock ``self.clock``'s data: shard 0's data view of
        that clock (``ps/data_views.py``), or before the first one the job's first view.  A worker
        that is not in it was removed from the job (declared dead, or it left): it stops."""
        wid = self.client.worker_id
        got = split_of(self.client.data_views[1], self.clock, wid)
        if got is None:
            self.data_view_start = -1
            return (
                (self.first_members.index(wid), len(self.first_members))
                if wid in self.first_members
                else None
            )
        rank, world, self.data_view_start = got
        if rank < 0:
            raise FlotillaError(
                f"worker {wid} is not in the parameter server's data view of clock {self.clock} "
                f"(from clock {self.data_view_start}): it was declared dead or left the job"
            )
        return rank, world

    def record_fields(self) -> dict[str, Any]:
        return {
            "data_view": self.data_view_start,
            "clock": self.clock - 1,
            "pull_wait_s": self.pull_wait_s,
            "pulled": self.pulled,
            "read_c_global": self.read_c_global,
        }

    def before_eval(self) -> None:
        self.refresh(self.clock)  # evaluate the global weights, not the cache

    def finalize(self, stop: Callable[[], bool]) -> bool:
        return self.pull_final(self.clock, stop=stop)

    @property
    def read_c_global(self) -> int:
        """Lower bound of the global clock of the weights held (see the module doc)."""
        return self._held_c_global

    def _values(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.params.items()}

    def initialize(self) -> None:
        """Register, seed the servers with this model's parameters unless another worker did
        (idempotent), and pull the global initial parameters."""
        self.client.hello(self.clock)
        joined = self.client.clocks[0]  # a worker joining mid-run starts at the shards' c_global
        if joined != self.clock:  # (or the shards were cut from a previous job's: ps/reshard.py)
            log.info("worker %d starts at the parameter server's clock %d", self.client.worker_id, joined)
        self.clock, self.start_step = joined, joined * self.wave_size
        self.client.initialize(self._values())
        self.pull(self.clock)

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

    def close(self, *, leave: bool = True) -> None:
        """Leave the job (so gated peers stop waiting for us) and close the connections."""
        if self._closed:
            return
        self._closed = True
        self.staging.close()
        try:
            if leave:
                self.client.leave(finished=self._finished)
        except CommError as exc:
            log.warning("leaving the parameter server failed: %s", exc)
        finally:
            self.client.close()
