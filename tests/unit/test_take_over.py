"""``SyncStrategy.take_over`` at the job's end, on a finished worker that is not rank 0: where
finished workers wait (``end_wait_s``), it takes over when the coordinator names it (``chosen``)
and leaves when the job ends; with ``end_standby`` (the parameter server) it leaves as soon as it
is not the coordinator's standby, and otherwise waits for the job's end however long."""

from __future__ import annotations

import math
from typing import Any

import pytest

from flotilla.sync.base import SyncStrategy

pytestmark = pytest.mark.timeout(30)  # (a standby that ignored standby() would wait for ever)


class _Ending(SyncStrategy):
    kind = "test"

    def __init__(self, end_wait_s: float, standby: bool) -> None:
        self.end_wait_s, self.end_standby, self.finalized = end_wait_s, standby, 0

    def begin_step(self, step: int) -> None:
        pass

    def synchronize(self, proposal: Any) -> Any:
        raise AssertionError("not at the end")

    def finalize(self, stop: Any) -> bool:
        self.finalized += 1
        return True


def _ticks(*values: bool) -> Any:
    """A callable answering ``values`` in turn, then the last one for ever."""
    seq = list(values)
    return lambda: seq.pop(0) if len(seq) > 1 else seq[0]


def test_a_waiting_worker_takes_over_when_named_and_leaves_when_the_job_ends() -> None:
    s = _Ending(end_wait_s=5.0, standby=False)
    assert s.take_over(stop=_ticks(False, False, False), chosen=_ticks(False, False, True))
    assert s.finalized == 1
    s = _Ending(end_wait_s=5.0, standby=False)
    assert not s.take_over(stop=_ticks(False, True), chosen=_ticks(False)) and s.finalized == 0
    s = _Ending(end_wait_s=0.0, standby=False)  # (it leaves at once)
    assert not s.take_over(stop=_ticks(False), chosen=_ticks(True)) and s.finalized == 0


def test_with_end_standby_only_the_standby_waits_and_it_waits_for_the_job_s_end() -> None:
    s = _Ending(end_wait_s=math.inf, standby=True)
    # (not the standby: it leaves at once, never asked to report)
    assert not s.take_over(stop=_ticks(False), chosen=_ticks(False), standby=_ticks(False))
    # (the standby until a later finisher relieves it)
    assert not s.take_over(stop=_ticks(False), chosen=_ticks(False), standby=_ticks(True, True, False))
    # (the standby, then named: the worker due to report died first)
    assert s.take_over(stop=_ticks(False), chosen=_ticks(False, False, True), standby=_ticks(True))
    assert s.finalized == 1
