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

How a clock's push and pull travel -- one round trip, cached reads (a push alone while the
weights held satisfy the SSP bound), read-ahead (the next clock's pull in flight while this one
computes), host staging on a GPU -- is ``sync/ps_exchange.PSExchange``'s, which this class
inherits.

Invariants: only trainable parameters are PS keys (buffers stay local); after ``pull`` the
model's parameters equal the global ones bitwise; ``push(c)`` must follow ``pull(c)`` (or
``initialize`` for c = 0) and clocks go up by one; the weights used for clock k always include
every worker's updates for clocks < ``read_c_global`` (reported per clock) and
``read_c_global >= k - s`` under SSP.
"""

from __future__ import annotations

import math
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
from flotilla.ps.read_rules import read_mode_notes
from flotilla.sync.base import Outcome, Proposal, Regime, SyncStrategy, Traits
from flotilla.sync.ps_exchange import PSExchange
from flotilla.sync.ps_staging import Copies, HostStaging
from flotilla.sync.ps_update import WorkerUpdate

__all__ = ["PSSync"]

log = get_logger("sync.via_ps")
GONE_CHECK_S = 1.0  # a parked pull is re-issued (and the dead evicted) at least this often


class PSSync(PSExchange, SyncStrategy):
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
    # (a finished worker leaves at once -- workers may end far apart -- but the last to finish stands
    # by until the job's end: the final weights are the servers', so it can report them should the
    # worker due to die first; docs/membership.md)
    end_wait_s = math.inf
    end_standby = True

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
