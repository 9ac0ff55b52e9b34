"""Pure membership views and the speed emulator (who enters which view: test_rendezvous.py)."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.cluster.emulation import SpeedEmulator, run_queue_wait_s
from flotilla.cluster.membership import View, merge_since, successor
from flotilla.core.clock import ManualClock


def test_successor_views_record_who_joined_and_left() -> None:
    v1 = View(epoch=1, members=(0, 1, 2))
    v2 = successor(v1, (0, 2))
    assert (v2.epoch, v2.members, v2.left, v2.joined) == (2, (0, 2), (1,), ())
    v3 = successor(v2, (0, 2, 7))
    assert (v3.epoch, v3.members, v3.joined) == (3, (0, 2, 7), (7,))
    assert v3.rank_of(7) == 2 and v3.rank_of(0) == 0
    v4 = successor(v3, (7,))
    assert v4.members == (7,) and v4.left == (0, 2)
    with pytest.raises(KeyError, match="not a member"):
        v4.rank_of(0)


def test_view_rejects_unsorted_or_duplicate_members() -> None:
    with pytest.raises(ValueError, match="unique and sorted"):
        View(epoch=1, members=(2, 1))
    with pytest.raises(ValueError, match="unique and sorted"):
        View(epoch=1, members=(1, 1))


def test_skipped_views_are_merged_relative_to_the_adopted_one() -> None:
    adopted = View(epoch=1, members=(0, 1, 2))
    v2 = successor(adopted, (0, 1, 2, 3))  # never adopted
    v3 = successor(v2, (1, 2, 3))
    merged = merge_since(adopted, v3)
    assert merged.epoch == 3 and merged.joined == (3,) and merged.left == (0,)
    assert set(merged.members) & set(adopted.members) == {1, 2}  # survivors that hold the model


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["join", "leave"]), st.integers(0, 9)), max_size=40))
def test_random_event_sequences_keep_the_invariants(events: list[tuple[str, int]]) -> None:
    view = View(epoch=1, members=(0,))
    expected = {0}
    for kind, wid in events:
        (expected.add if kind == "join" else expected.discard)(wid)
        new = successor(view, tuple(sorted(expected)))
        assert set(new.members) == expected and new.epoch == view.epoch + 1
        assert set(new.joined) == expected - set(view.members)
        assert set(new.left) == set(view.members) - expected
        assert View.from_dict(new.to_dict()) == new
        view = new


def test_emulator_stretches_measured_compute() -> None:
    clock = ManualClock()
    slept: list[float] = []

    def sleep(dt: float) -> None:
        slept.append(dt)
        clock.advance(dt)

    emu = SpeedEmulator(0.25, now=clock.now, sleep=sleep)
    emu.start()
    clock.advance(0.1)
    assert emu.mark() == pytest.approx(0.3)  # 0.1 s of compute lasts 0.4 s at speed 0.25
    clock.advance(0.02)
    emu.mark()
    assert slept == pytest.approx([0.3, 0.06])
    assert emu.reset_counters() == pytest.approx((0.12, 0.36))
    fast = SpeedEmulator(1.0, now=clock.now, sleep=sleep)
    clock.advance(1.0)
    assert fast.mark() == 0.0 and len(slept) == 2
    with pytest.raises(ValueError, match="speed"):
        SpeedEmulator(0.0)


def test_the_emulated_device_does_not_pay_for_waits_for_a_shared_core() -> None:
    """An interval whose thread waited for a core (four emulated devices on two cores) lasts its
    compute *less the wait* times 1/speed: the device is as slow as its speed, not as crowded as
    the host.  A wait longer than the stretch can absorb sleeps nothing (never less than the wall)."""
    clock, waited = ManualClock(), [0.0]
    slept: list[float] = []

    def sleep(dt: float) -> None:
        slept.append(dt)
        clock.advance(dt)

    emu = SpeedEmulator(0.25, now=clock.now, sleep=sleep, waited=lambda: waited[0])
    emu.start()
    clock.advance(0.1)
    waited[0] += 0.04  # 0.04 s of the 0.1 s waiting for a core: 0.06 s of compute
    assert emu.mark() == pytest.approx(0.24 - 0.1)  # it lasts 4 x 0.06 in all
    clock.advance(0.1)
    waited[0] += 0.09  # 0.01 s of compute: 0.04 s at this speed, less than the 0.1 s it took
    assert emu.mark() == 0.0
    assert emu.reset_counters() == pytest.approx((0.2, 0.14))  # (compute_s: the wall time measured)
    never = SpeedEmulator(1.0, now=clock.now, sleep=sleep, waited=lambda: 1 / 0)  # (never read)
    clock.advance(0.5)
    assert never.mark() == 0.0 and len(slept) == 1


def test_the_run_queue_wait_never_goes_back_and_another_threads_is_not_subtracted() -> None:
    """The counter is the calling thread's (cumulative: never back).  An interval begun on one
    thread and ended on another (a CUDA backward's hooks) subtracts nothing: the two counters
    are not comparable."""
    a = run_queue_wait_s()
    sum(i * i for i in range(200_000))  # (some compute; the wait may or may not grow)
    assert 0.0 <= a <= run_queue_wait_s()
    clock, waited = ManualClock(), [0.0]
    slept: list[float] = []
    emu = SpeedEmulator(0.5, now=clock.now, sleep=slept.append, waited=lambda: waited[0])
    emu.start()
    clock.advance(0.1)
    waited[0] += 0.05  # (what a same-thread mark would subtract)
    done: list[float] = []
    t = threading.Thread(target=lambda: done.append(emu.mark()))
    t.start()
    t.join()
    assert done == [pytest.approx(0.1)]  # (0.1 s of compute lasts 0.2 s: nothing subtracted)
    emu.start()
    clock.advance(0.1)
    waited[0] += 0.05
    assert emu.mark() == pytest.approx(0.0)  # (same thread: 0.05 s of compute, 0.1 s at 0.5)
