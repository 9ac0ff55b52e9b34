"""``Group.vote`` (real processes, gloo): a member that stopped running inside the vote does not
apply the step; a member that only waited for a late peer does.

Why (chaos run of 1a98b32, seed 102): a worker SIGSTOPped inside the vote of a step, after its
ring all-reduce had completed on its side, woke 5 s later and applied the step its peers had
discarded (they had found it silent and aborted the view).  Now its vote fails instead: it
discards the step and recovers like its peers (docs/membership.md, "A frozen member's vote").

Member A enters the vote first (the patched ``Handle.wait`` says when it is waiting, so the
signal always lands inside the vote); the test then either freezes A (SIGSTOP) for longer than
A's ``stall_limit_s`` before letting B in, or just lets B in late by as much.  Only the freeze
makes A refuse, and B, which never stopped, gets the result either way.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest

from flotilla.comm.store import StoreAddress, StoreHost

pytestmark = pytest.mark.timeout(120)

LIMIT_S = 0.25  # A's allowance (the default peer heartbeat's ``unsuspected_s``)
HOLD_S = 1.0  # how long A is frozen, or waits for B: four allowances


def _member(rank: int, address: tuple[str, int], waiting: Any, go: Any, out: Any) -> None:
    import torch

    from flotilla.comm import collective
    from flotilla.comm.store import connect_store
    from flotilla.core.errors import CollectiveError

    torch.set_num_threads(1)
    store = connect_store(StoreAddress(*address))
    group = collective.Group(
        store, namespace="vote", rank=rank, world_size=2, timeout_s=30.0, stall_limit_s=LIMIT_S
    )
    group.barrier()
    if rank == 0:  # say when A waits in the vote (after its clock started)
        plain = collective.Handle.wait

        def wait(self: Any, since: float | None = None) -> None:
            waiting.set()
            plain(self, since)

        collective.Handle.wait = wait  # type: ignore[method-assign]
    if rank == 1:
        go.wait(60)
    vote = torch.tensor([float(rank), 0.0], dtype=torch.float64)
    try:
        group.vote(vote)
        out.put((rank, "applied", vote.tolist()))
    except CollectiveError as exc:
        out.put((rank, "refused", str(exc)))
    group.close()


def _run(freeze: bool) -> dict[int, tuple[str, Any]]:
    host = StoreHost("127.0.0.1")
    ctx = mp.get_context("spawn")
    waiting, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    address = (host.address.host, host.address.port)
    procs = [ctx.Process(target=_member, args=(r, address, waiting, go, out)) for r in (0, 1)]
    try:
        for p in procs:
            p.start()
        assert waiting.wait(90), "member A never entered the vote"
        if freeze:
            os.kill(procs[0].pid, signal.SIGSTOP)  # type: ignore[arg-type]
        time.sleep(HOLD_S)  # (the stimulus: how long A is frozen, or waits for B)
        if freeze:
            os.kill(procs[0].pid, signal.SIGCONT)  # type: ignore[arg-type]
        go.set()
        got = {}
        for _ in procs:
            rank, verdict, detail = out.get(timeout=60)
            got[rank] = (verdict, detail)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
        return got
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)  # type: ignore[arg-type]
                p.kill()
        host.close()


def test_a_member_frozen_inside_the_vote_does_not_apply_it() -> None:
    got = _run(freeze=True)
    verdict, detail = got[0]
    print(f"\nA: {verdict}: {detail}\nB: {got[1]}")
    assert verdict == "refused", f"A applied a vote it was frozen in: {detail}"
    assert "stopped running for" in detail and "the step is not applied" in detail
    stopped = float(detail.split("stopped running for ")[1].split(" s")[0])
    assert stopped >= HOLD_S * 0.8, detail  # (the freeze it measured is the one it had)
    assert got[1] == ("applied", [1.0, 0.0]), "B, which never stopped, must get the result"


def test_a_member_that_only_waited_for_a_late_peer_applies_the_vote() -> None:
    got = _run(freeze=False)
    print(f"\nA: {got[0]}\nB: {got[1]}")
    assert got[0] == ("applied", [1.0, 0.0]), f"waiting {HOLD_S} s for a peer is not stalling: {got[0]}"
    assert got[1] == ("applied", [1.0, 0.0])
