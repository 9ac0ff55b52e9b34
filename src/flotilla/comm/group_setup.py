"""Building and destroying a group's backend without waiting on a dead or frozen member
(``comm/collective.py`` uses these).

- :func:`arrive`: every member announces itself in the group's namespace and waits for the
  others, giving up as soon as ``cancelled`` says a member is known dead;
- :func:`build_cancellable`: the backend's own rendezvous (gloo's full-mesh connect, which the
  caller cannot interrupt) runs on a thread of its own; the caller polls ``cancelled`` and gives
  up at once when a member died *after* arriving, leaving the abandoned construction to fail (or
  finish) on its thread, whose backend is then destroyed like any other;
- :func:`backend_maker`: how a gloo or NCCL backend of a group is built (its rendezvous in the
  group's prefixed store); :func:`abort_nccl` ends an NCCL backend's communicators before it is
  dropped;
- :func:`dispose_later` / :func:`wait_disposed`: a backend is destroyed on a thread of its own
  (gloo's destructor joins its work threads, and one blocked on a frozen peer waits until that
  peer wakes or the collective times out); ``wait_disposed`` waits for every such thread, and
  for every abandoned construction.
"""

from __future__ import annotations

import datetime as _dt
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from flotilla.comm.addresses import gloo_options, prepare_nccl
from flotilla.comm.handle import first_line
from flotilla.core.errors import CollectiveError
from flotilla.core.log import get_logger

__all__ = [
    "DISPOSE_WAIT_S", "abort_nccl", "arrive", "backend_maker", "build_cancellable", "dispose_later",
    "wait_disposed",
]  # fmt: skip

log = get_logger("comm.collective")

DISPOSE_WAIT_S = 0.2
POLL_S = 0.02
_disposing: set[threading.Thread] = set()
_disposing_lock = threading.Lock()


def arrive(store: Any, rank: int, world_size: int, deadline: float, cancelled: Callable[[], bool]) -> None:
    """Announce this member under the group's namespace and wait, checking at least every 20 ms,
    until every member has: the backend's own rendezvous then completes at once, and a member
    known dead is given up on as soon as ``cancelled`` says so, not after the timeout."""
    store.set(f"arrive/{rank}", b"1")
    keys = [f"arrive/{r}" for r in range(world_size)]
    pause = 0.002
    while not store.check(keys):  # (not store.wait: torch logs every timed-out wait)
        if cancelled():
            raise CollectiveError("group rendezvous cancelled: a member is known dead")
        if time.perf_counter() >= deadline:
            raise CollectiveError(
                f"group rendezvous failed: not every member arrived ({world_size} expected)"
            )
        time.sleep(pause)
        pause = min(2 * pause, POLL_S)


def build_cancellable(make: Callable[[], Any], cancelled: Callable[[], bool]) -> Any:
    """``make()`` (a backend's construction, which releases the GIL while it waits) on a thread
    of its own; its result, or its exception re-raised -- or CollectiveError as soon as
    ``cancelled()`` (the construction is abandoned: its backend, if it ever forms, is destroyed)."""
    box: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append(make())
        except BaseException as exc:  # (handed to the caller, or dropped if it gave up)
            box.append(exc)
        finally:
            done.set()
            with _disposing_lock:
                _disposing.discard(threading.current_thread())

    thread = threading.Thread(target=run, name="group-setup", daemon=True)
    with _disposing_lock:
        _disposing.add(thread)  # (wait_disposed waits for an abandoned construction too)
    thread.start()
    while not done.wait(POLL_S):
        if cancelled():
            threading.Thread(target=_reap, args=(done, box), name="group-reap", daemon=True).start()
            raise CollectiveError("group rendezvous cancelled: a member is known dead")
    result = box[0]
    if isinstance(result, BaseException):
        raise result
    return result


def _reap(done: threading.Event, box: list[Any]) -> None:
    """Destroy the backend of an abandoned construction once it is over."""
    done.wait()
    if box and not isinstance(box[0], BaseException):
        dispose_later(box)
    else:
        box.clear()


def dispose_later(holder: list[Any]) -> threading.Thread:
    """Shut the backend in ``holder`` (its only reference) down on a thread of its own."""
    thread = threading.Thread(target=_dispose, args=(holder,), name="group-dispose", daemon=True)
    with _disposing_lock:
        _disposing.add(thread)
    thread.start()
    return thread


def _dispose(holder: list[Any]) -> None:
    """Shut a backend down and drop the last reference to it (its sockets close)."""
    try:
        holder[0].shutdown()
    except Exception:
        pass
    holder.clear()
    with _disposing_lock:
        _disposing.discard(threading.current_thread())


def wait_disposed(timeout_s: float = 30.0) -> bool:
    """Wait for every backend still being destroyed or abandoned in construction (e.g. before
    checking for leaked threads, or before a normal interpreter exit); True when none is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _disposing_lock:
            pending = list(_disposing)
        if not pending:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        pending[0].join(left)


def backend_maker(
    backend: str, store: Any, prefixed: Any, rank: int, world_size: int, rdv_s: float
) -> Callable[[], Any]:
    """A function building the backend (gloo or NCCL) of rank ``rank`` of ``world_size``, its
    rendezvous in ``prefixed`` (the group's namespace of ``store``) within ``rdv_s``."""

    def make() -> Any:
        timeout = _dt.timedelta(seconds=rdv_s)
        if backend == "gloo":  # (the device binds the address that reaches the store)
            return dist.ProcessGroupGloo(prefixed, rank, world_size, gloo_options(store, timeout))
        prepare_nccl(store)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)

    return make


def abort_nccl(pg: Any) -> None:
    """Abort an NCCL backend's communicators (``ProcessGroupNCCL.abort``): its in-flight kernels
    end, so destroying it cannot wait on a dead peer.  Errors are ignored (it is being dropped)."""
    abort = getattr(pg, "abort", None)
    if abort is None:
        return
    try:
        abort()
    except Exception as exc:  # (an already broken communicator)
        log.debug("nccl abort: %s", first_line(exc))
