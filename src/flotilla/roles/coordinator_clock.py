"""The coordinator's clock origin as seen from another process on this machine.

Records carry ``time_s``: seconds since the coordinator's ``t0``.  A tool that kills a process at a
wall-clock instant (a test, a benchmark) needs ``t0`` on its own clock to place that instant among
the records: it asks the coordinator's ``status`` (which reports ``elapsed_s``) and takes the
midpoint of the call, so the error is at most half the call's round trip.
"""

from __future__ import annotations

import time

from flotilla.comm.msgplane import connect

__all__ = ["coordinator_t0_unix"]


def coordinator_t0_unix(address: str, secret: bytes, *, sender: str, timeout_s: float = 10.0) -> float:
    """The coordinator's ``t0`` as a Unix time (``address``: ``tcp://host:port`` or ``host:port``)."""
    if "://" not in address:
        address = f"tcp://{address}"
    client = connect(address, secret, sender=sender)
    try:
        before = time.time()
        elapsed = float(client.call("status", {}, timeout_s=timeout_s).body["elapsed_s"])
        after = time.time()
    finally:
        client.close()
    return (before + after) / 2 - elapsed
