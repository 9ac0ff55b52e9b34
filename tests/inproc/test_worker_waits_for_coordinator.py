"""A worker started before its coordinator (a scheduler starts every task at once) waits for it
to answer, then fails in one line naming the address if it never does."""

from __future__ import annotations

import time

import pytest

from flotilla.comm.auth import generate_secret
from flotilla.core.errors import CommError
from flotilla.roles.worker import Worker, WorkerOptions


def test_a_worker_gives_up_on_a_silent_coordinator_naming_its_address():
    opts = WorkerOptions(
        coordinator="tcp://127.0.0.1:9", secret=generate_secret(), name="w0", coordinator_wait_s=1.0
    )
    t0 = time.monotonic()
    with pytest.raises(CommError, match=r"coordinator at tcp://127.0.0.1:9 did not answer within 1 s"):
        Worker(opts).run()
    # the wait is 1 s, one describe call 2 s; no flush of records it never had (it lingered 30 s)
    assert time.monotonic() - t0 < 20
