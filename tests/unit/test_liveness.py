"""Liveness connections (``comm/liveness.py``): a peer's process death is reported at once, a
frozen (SIGSTOPped) peer is not, a peer that was never up is reported when refused, and a
connection the network resets (``comm/faulty.py``'s ``liveness_reset``) while its peer lives is
held again, never reported -- while a death among the resets still is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from flotilla.comm import faulty
from flotilla.comm.faulty import NetFaults
from flotilla.comm.liveness import LivenessListener, LivenessWatch

CHILD = """
import sys, time
from flotilla.comm.liveness import LivenessListener
listener = LivenessListener("127.0.0.1")
print(listener.port, flush=True)
time.sleep(600)
"""


def _child() -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _collector() -> tuple[list[int], threading.Event, LivenessWatch]:
    closed: list[int] = []
    event = threading.Event()

    def on_closed(peer: int, graceful: bool) -> None:
        closed.append(-peer if graceful else peer)
        event.set()

    return closed, event, LivenessWatch(on_closed, poll_s=0.05)


def test_a_killed_peer_is_reported_at_once_and_once() -> None:
    proc, port = _child()
    closed, event, watch = _collector()
    try:
        watch.watch({7: ("127.0.0.1", port)})
        time.sleep(0.3)  # (connected; a live peer is never reported)
        assert closed == []
        t0 = time.monotonic()
        proc.kill()
        assert event.wait(10), "the killed peer was not reported"
        print(f"kill -> reported in {time.monotonic() - t0:.3f} s")
        time.sleep(0.2)
        assert closed == [7]
    finally:
        watch.close()
        proc.kill()
        proc.wait()


def test_a_frozen_peer_is_not_reported() -> None:
    proc, port = _child()
    closed, _event, watch = _collector()
    try:
        watch.watch({3: ("127.0.0.1", port)})
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.5)
        assert closed == []
        os.kill(proc.pid, signal.SIGCONT)
    finally:
        watch.close()
        proc.kill()
        proc.wait()


def test_a_listener_closed_on_purpose_says_goodbye() -> None:
    listener = LivenessListener("127.0.0.1")
    closed, event, watch = _collector()
    try:
        watch.watch({5: ("127.0.0.1", listener.port)})
        time.sleep(0.3)
        listener.close()
        assert event.wait(10)
        assert closed == [-5]  # graceful: not a death
    finally:
        watch.close()


def test_a_refused_listener_is_reported_and_an_unwatched_peer_is_dropped() -> None:
    listener = LivenessListener("127.0.0.1")
    port = listener.port
    listener.close()
    other = LivenessListener("127.0.0.1")
    closed, event, watch = _collector()
    try:
        watch.watch({1: ("127.0.0.1", port), 2: ("127.0.0.1", other.port)})
        assert event.wait(10)
        watch.watch({})  # 2 is no longer watched: closing its listener reports nothing
        time.sleep(0.2)
        other.close()
        time.sleep(0.3)
        assert closed == [1]
    finally:
        watch.close()
        other.close()


def test_connections_reset_by_the_network_are_held_again_and_a_death_among_them_is_reported() -> None:
    proc, port = _child()
    faulty.install(NetFaults(liveness_reset=0.5, seed=3))  # (half of the polls reset the connection)
    try:
        closed, event, watch = _collector()  # (the watch draws its resets from the plan it was made under)
    finally:
        faulty.install(None)
    try:
        watch.watch({4: ("127.0.0.1", port)})
        deadline = time.monotonic() + 30
        while watch.resets < 20 and time.monotonic() < deadline and not closed:
            time.sleep(0.05)
        assert closed == [] and watch.resets >= 20, (closed, watch.resets)
        assert watch.reconnected >= watch.resets - 1  # (each reset: its listener answered again)
        t0 = time.monotonic()
        proc.kill()
        assert event.wait(10), "the killed peer was not reported"
        print(f"\n{watch.resets} resets held again; kill -> reported in {time.monotonic() - t0:.3f} s")
        time.sleep(0.3)
        assert closed == [4]
    finally:
        watch.close()
        proc.kill()
        proc.wait()


def test_a_frozen_peer_whose_connection_is_reset_is_not_reported() -> None:
    proc, port = _child()
    faulty.install(NetFaults(liveness_reset=1.0))
    try:
        closed, _event, watch = _collector()
    finally:
        faulty.install(None)
    try:
        watch.watch({2: ("127.0.0.1", port)})
        os.kill(proc.pid, signal.SIGSTOP)  # (its kernel still accepts: frozen is not dead)
        deadline = time.monotonic() + 30
        while watch.resets < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.resets >= 5 and closed == [], (watch.resets, closed)
        os.kill(proc.pid, signal.SIGCONT)
    finally:
        watch.close()
        proc.kill()
        proc.wait()
