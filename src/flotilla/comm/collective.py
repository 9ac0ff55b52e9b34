"""Collective plane: process groups named by an opaque namespace, never the global default group.

A :class:`Group` is ``(store, namespace, rank, world_size)`` for ANY member set: a membership
view's group (``EpochGroup``: namespace ``epoch/<n>/``), a P-member partial-reduce group, a pair,
a virtual worker's stages.  Two groups with different namespaces never see each other's
rendezvous keys, so any number of them can coexist in one process.

Invariants
- Every collective has a timeout: the group's default (``timeout_s``) and an explicit wait bound.
- Collective waits are sliced (``WAIT_SLICE_S``): another thread may :meth:`Group.abort` a
  group, and every collective wait on it then raises :class:`~flotilla.core.errors.CollectiveError`
  within one slice (the coordinator's "epoch broken" notice uses this, so no survivor waits out
  ``timeout_s``).  Point-to-point waits (``send``/``recv``) are NOT sliced: on gloo a timed-out
  point-to-point wait closes every connection of the group ("Application timeout caused pair
  closure"), so they wait in one piece, up to ``timeout_s`` (a peer's death still ends them at
  once: its connections close).
- A failed wait, ``abort`` and ``close`` drop every reference this module holds to the torch
  backend and its in-flight work, so the backend is destroyed and its sockets are closed at
  once (on a thread of its own: the destructor may wait for a frozen peer, the caller does
  not).  That matters: a peer blocked in a collective on us sees "connection closed" right away
  instead of waiting out its timeout (failures cascade through a broken ring in milliseconds,
  measured in ``benchmarks/crash_recovery.py``).
- Failures surface as :class:`~flotilla.core.errors.CollectiveError`; strategies turn them into
  data (``Outcome.broken``) and the loop recovers.  That includes every error raised while a group
  is created (only the arguments' own checks raise ``ValueError``, before anything is contacted):
  junk planted in the store is a failed rendezvous, never an escaping exception.
- A step's vote is :meth:`Group.vote`: applied only if this member kept running while it was in
  flight (a frozen member's peers may have given up on it and discarded the step).
- A construction that may be abandoned (``cancelled``) meets in the store over a connection of
  its own (``comm.store.private_connection``), so a rendezvous left blocked never holds the
  process's shared store connection.
- A one-member group has no backend: its collectives are the identity and complete at once
  (``comm/one_member.py``); it still aborts and closes like any other.
"""

from __future__ import annotations

import datetime as _dt
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from flotilla.comm.faulty import collective_reset_draw
from flotilla.comm.group_setup import DISPOSE_WAIT_S, arrive, build_cancellable, dispose_later
from flotilla.comm.group_setup import abort_nccl as abort_nccl  # (re-exported)
from flotilla.comm.group_setup import backend_maker as _backend_maker  # (re-exported: tests/gpu)
from flotilla.comm.group_setup import wait_disposed as wait_disposed  # (re-exported)
from flotilla.comm.handle import Handle, first_line
from flotilla.comm.one_member import OneMember
from flotilla.comm.shaping import Shaping, installed
from flotilla.comm.shaping_groups import NAMES_WAIT_S, GroupShaper
from flotilla.comm.store import private_connection
from flotilla.core.errors import CollectiveError

_OPS: dict[str, Any] = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _td(seconds: float) -> _dt.timedelta:
    return _dt.timedelta(seconds=seconds)


class CollectiveFaults(Protocol):
    """Faults a test plan injects at a group's collectives (``core/faults.FaultInjector``; the
    roles' group factories install it, no strategy calls it).  ``launching``: before a collective
    is launched (it may crash the process, stop it, delay it, or raise CollectiveError);
    ``voting``: before a vote (:meth:`Group.vote`), it may raise this member's failure code (the
    vote's first element) so that every member discards the step."""

    def launching(self, group: Group) -> None: ...

    def voting(self, group: Group, tensor: torch.Tensor) -> None: ...


class Group:
    """A gloo (CPU) or NCCL (CUDA) process group of ``world_size`` members named ``namespace``.

    ``timeout_s`` bounds every collective; ``rendezvous_timeout_s`` (default ``timeout_s``)
    bounds creation: every member must construct the group with the same namespace.

    ``backend="nccl"`` needs ``device`` (this rank's GPU, one GPU per rank): tensors that live
    elsewhere (the small CPU votes and probes, received state) are staged through it.

    Thread-safety: collectives run on one thread; :meth:`abort` may be called from any thread.
    """

    def __init__(
        self,
        store: dist.Store,
        *,
        namespace: str,
        rank: int,
        world_size: int,
        timeout_s: float = 30.0,
        backend: str = "gloo",
        rendezvous_timeout_s: float | None = None,
        device: torch.device | None = None,
        cancelled: Callable[[], bool] | None = None,
        stall_limit_s: float | None = None,
        faults: CollectiveFaults | None = None,
        shaping: Shaping | None = None,
    ) -> None:
        """``cancelled``: polled while waiting for the other members to arrive (every
        ``WAIT_SLICE_S``); once it returns True the construction gives up with CollectiveError
        (a member of this group is known dead: it will never arrive).  ``stall_limit_s``: how
        long this member may stop running before a peer may give up on it (:meth:`vote`);
        ``faults``: a test's fault plan at this group's collectives (:class:`CollectiveFaults`);
        ``shaping``: the emulated links its traffic takes (``comm/shaping.py``; default: the
        process's, installed from ``cluster.links.emulate``)."""
        if stall_limit_s is not None and not stall_limit_s > 0:
            raise ValueError(f"stall_limit_s must be > 0, got {stall_limit_s}")
        self.stall_limit_s = stall_limit_s
        self.faults = faults
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be one of gloo, nccl; got {backend!r}")
        if backend == "nccl" and (device is None or device.type != "cuda"):  # (gloo ignores device)
            raise ValueError(f"backend nccl needs a cuda device, got {device!r}")
        if not namespace:
            raise ValueError("a group needs a non-empty namespace")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self._device = device if backend == "nccl" else None
        self.namespace = namespace if namespace.endswith("/") else namespace + "/"
        self.rank, self.world_size = rank, world_size
        self.timeout_s = timeout_s
        # (a test's network resets this group's connections: comm/faulty.py, ``collective_reset``)
        self._reset = collective_reset_draw(f"{self.namespace}{rank}") if world_size > 1 else None
        self.aborted = False
        self.abort_reason = ""
        self._handles: weakref.WeakSet[Handle] = weakref.WeakSet()
        self._pg: Any = None
        self._shaper: GroupShaper | None = None
        prefixed = dist.PrefixStore(self.namespace, store)
        rdv_s = rendezvous_timeout_s if rendezvous_timeout_s is not None else timeout_s
        shaping = shaping if shaping is not None else installed()
        if world_size == 1:
            shaping = None  # (a one-member group sends nothing)
        t0 = time.perf_counter()
        try:
            if shaping is not None:  # (before the rendezvous: every name is there once it completes)
                GroupShaper.publish(prefixed, rank, shaping.me)
            if world_size > 1 and cancelled is not None:
                arrive(prefixed, rank, world_size, t0 + rdv_s, cancelled)
            if world_size == 1:
                self._pg = OneMember()
            else:
                if cancelled is not None:  # (a construction that may be abandoned: own connection)
                    own = private_connection(store)
                    make = _backend_maker(
                        backend, own, dist.PrefixStore(self.namespace, own), rank, world_size, rdv_s
                    )
                else:
                    make = _backend_maker(backend, store, prefixed, rank, world_size, rdv_s)
                # (a member that dies after arriving leaves the backend's own rendezvous
                # waiting for it: with ``cancelled`` that wait is abandoned, not sat out)
                self._pg = make() if cancelled is None else build_cancellable(make, cancelled)
                if backend == "gloo":
                    self._pg._set_default_timeout(_td(timeout_s))
            if shaping is not None:
                self._shaper = GroupShaper.join(
                    shaping, prefixed, rank, world_size, wait_s=min(rdv_s, NAMES_WAIT_S), on_fail=self.abort
                )
        except CollectiveError as exc:
            self._drop_backend()
            raise CollectiveError(f"{self.namespace}: {exc}") from None
        except Exception as exc:  # (ValueError too: gloo's parser on junk store values raises one)
            self._drop_backend()
            raise CollectiveError(f"{self.namespace}: group rendezvous failed: {first_line(exc)}") from None
        self.setup_s = time.perf_counter() - t0  # rendezvous included (the slowest member's arrival)

    def _drop_backend(self) -> None:
        """A construction failed after its backend was built: release it (peers see that)."""
        if self._pg is not None:
            self.aborted, self.abort_reason = True, "construction failed"
            self.close()

    @property
    def backend(self) -> str:
        """``nccl`` or ``gloo`` (a one-member group runs neither: its collectives are identities)."""
        return "nccl" if self._device is not None else "gloo"

    @property
    def process_group(self) -> object:
        """The raw torch *backend* object (gloo/NCCL), not a ``ProcessGroup``.

        Torch components that want a ``ProcessGroup`` (DDP) need it wrapped; see
        ``benchmarks/ssgd_vs_ddp.py::_as_process_group``.
        """
        return self._pg

    def _check_open(self) -> Any:
        pg = self._pg
        if pg is None or self.aborted:
            raise CollectiveError(f"{self.namespace}: group {self.abort_reason or 'closed'}")
        return pg

    def _staged(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], Any] | None]:
        """``tensor`` on the group's device, and how to copy a result back (None: no staging)."""
        if self._device is None or tensor.device == self._device:
            return tensor, None
        staged = tensor.to(self._device)
        return staged, lambda: tensor.copy_(staged)

    def _reset_by_network(self, what: str) -> None:
        """A test's network resets this group's connections before ``what`` (``comm/faulty.py``):
        the group fails as a broken connection fails it, peers blocked on it see that."""
        if self._reset is not None and self._reset():
            why = f"connection reset by the network as {what} was launched (NetFaults.collective_reset)"
            self.fail(why)
            raise CollectiveError(f"{self.namespace}: {why}")

    def _launch(
        self, start: Callable[[Any], Any], after: Callable[[], Any] | None, what: str, *, sliced: bool = True
    ) -> Handle:
        pg = self._check_open()
        self._reset_by_network(what)
        try:
            return Handle(start(pg), self, after, sliced=sliced)
        except Exception as exc:
            self.fail(f"{what} launch failed: {first_line(exc)}")
            raise CollectiveError(f"{self.namespace}: {what} launch failed: {first_line(exc)}") from None

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Handle:
        if self.faults is not None:
            self.faults.launching(self)
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[op]
        opts.timeout = _td(self.timeout_s)
        staged, back = self._staged(tensor)
        shaper = self._shaper
        if shaper is None:
            return self._launch(lambda pg: pg.allreduce([staged], opts), back, "allreduce")
        nbytes = _nbytes(staged)
        return self._launch(
            lambda pg: shaper.allreduce(pg.allreduce([staged], opts), nbytes), back, "allreduce"
        )

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.allreduce_async(tensor, op).wait()
        return tensor

    def vote(self, tensor: torch.Tensor, op: str = "max") -> torch.Tensor:
        """The all-reduce whose result decides a step, applied only if this returns.

        One all-reduce cannot be an atomic commit by itself: a member may hold the full result
        before its last send has left (ring all-reduce), and if that member then stops running
        (SIGSTOP, a paused VM, a starved host) for longer than its peers' silence watch allows,
        they give up on it and discard the step it is about to apply.  So when this member did
        not run for longer than ``stall_limit_s`` while the vote was in flight, the result is not
        trusted: the group fails (peers blocked on it see that at once) and CollectiveError
        says why.  Safe both ways: if the peers did commit, the next view's state agreement
        rolls this member forward (``trainer/state_sync.py``); if they did not, nobody did.
        Without ``stall_limit_s``, or alone, this is ``allreduce``.  On NCCL the check sees only a
        stop inside ``wait`` (its kernels run on the device; the host copy afterwards is not
        watched): the protection is gloo's.  The first element of ``tensor`` is this
        member's failure code (0: none; the step commits only if every member's is 0)."""
        if self.faults is not None:
            self.faults.voting(self, tensor)
        started = time.monotonic()
        handle = self.allreduce_async(tensor, op)
        handle.wait(since=started)
        limit = self.stall_limit_s  # (alone, nobody can give up on this member: no check)
        if limit is not None and self.world_size > 1 and handle.longest_gap_s > limit:
            why = (
                f"this member stopped running for {handle.longest_gap_s:.2f} s inside the vote "
                f"(over {limit:g} s its peers may have given up on it): the step is not applied"
            )
            self.fail(why)
            raise CollectiveError(f"{self.namespace}: {why}")
        return tensor

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        for t in tensors:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = src, 0
            opts.timeout = _td(self.timeout_s)
            staged, back = self._staged(t)
            start = _broadcast_starter(staged, opts)
            shaper = self._shaper
            if shaper is not None:
                start = _held_broadcast(start, shaper, src, _nbytes(staged))
            self._launch(start, back, "broadcast").wait()

    def _p2p_staged(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], Any] | None]:
        """:meth:`_staged`, and for gloo a CUDA tensor through host memory: gloo's collectives
        take CUDA tensors (they stage them), its point-to-point sends and receives do not."""
        if self._device is None and tensor.is_cuda:
            staged = tensor.to("cpu")
            return staged, lambda: tensor.copy_(staged)
        return self._staged(tensor)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        staged, _ = self._p2p_staged(tensor)
        shaper = self._shaper
        if shaper is None:
            return self._launch(lambda pg: pg.send([staged], dst, tag), None, "send", sliced=False)
        # (on its modelled link first: launched by the shaping thread, on the group's backend then)
        self._check_open()
        self._reset_by_network("send")
        if not 0 <= dst < self.world_size or dst == self.rank:
            self.fail(f"send launch failed: no peer {dst} in a group of {self.world_size}")
            raise CollectiveError(f"{self.namespace}: send launch failed: no peer {dst}")
        delayed = shaper.send(lambda: self._check_open().send([staged], dst, tag), dst, _nbytes(staged))
        return Handle(delayed, self, None, sliced=False)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        staged, back = self._p2p_staged(tensor)
        return self._launch(lambda pg: pg.recv([staged], src, tag), back, "recv", sliced=False)

    def barrier(self) -> None:
        flag = torch.zeros(1)
        self.allreduce(flag)

    def abort(self, reason: str = "aborted") -> None:
        """From any thread: every wait on this group raises within ``WAIT_SLICE_S``.  The owner
        thread then closes it (``close``)."""
        if not self.aborted:
            self.abort_reason = reason
            self.aborted = True
        if self._shaper is not None:  # (sends still on their emulated links fail now)
            self._shaper.close(f"group {self.abort_reason}")

    def fail(self, reason: str) -> None:
        """A collective of this group failed: release it at once, so that peers blocked on us
        see the failure too (see the module doc)."""
        self.abort(reason)
        self.close()

    def close(self) -> None:
        """Release the group; idempotent.  In-flight work is abandoned and its sockets closed."""
        if not self.aborted:
            self.abort("closed")
        for h in list(self._handles):
            h.drop()
        pg, self._pg = self._pg, None
        if pg is not None and self._device is not None:  # NCCL: abort its communicators first
            abort_nccl(pg)
        if pg is not None:
            # Destroyed on a thread of its own, waited for DISPOSE_WAIT_S: gloo's destructor joins
            # its work threads, and one blocked on a FROZEN peer (SIGSTOP: its sockets stay open)
            # waits until that peer wakes or the collective times out; the caller (a survivor
            # recovering) must not.  Any other destruction takes milliseconds and is over by then.
            holder = [pg]
            del pg
            dispose_later(holder).join(DISPOSE_WAIT_S)


def _broadcast_starter(staged: torch.Tensor, opts: Any) -> Callable[[Any], Any]:
    return lambda pg: pg.broadcast([staged], opts)


def _held_broadcast(
    start: Callable[[Any], Any], shaper: GroupShaper, src: int, nbytes: int
) -> Callable[[Any], Any]:
    return lambda pg: shaper.broadcast(start(pg), src, nbytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class EpochGroup(Group):
    """The group of one membership view: namespace ``epoch/<n>/``."""

    def __init__(self, store: dist.Store, *, epoch: int, rank: int, world_size: int, **kw: Any) -> None:
        super().__init__(store, namespace=f"epoch/{epoch}/", rank=rank, world_size=world_size, **kw)
        self.epoch = epoch
