"""``PSSync`` with its pushes and pulls staged through host buffers (``sync/ps_staging.py``, here
with plain copies: no GPU) against the plain path, on in-process servers: every push and every
clock's weights are equal bit for bit under each read mode and update rule, with gradient
accumulation, with and without the copies during backward; a synchronous push reuses one slot,
an asynchronous one (cached reads, read-ahead) alternates two and never hands out the one in
flight.  On a CPU model the default is the
pass-through (no hook, no buffer)."""

from __future__ import annotations

import pytest

from flotilla.config.schema import PSStrategy, SGDOptimizer
from flotilla.sync.ps_staging import PlainCopies
from tests.inproc._ps_staging import assert_equal_bitwise, lockstep

pytestmark = pytest.mark.timeout(90)

MODES = {
    "ssp-plain": PSStrategy(consistency="ssp", staleness=2, num_servers=2, chunk_bytes=256),
    "bsp-one-shard": PSStrategy(consistency="bsp", num_servers=1),
    "ssp-cached": PSStrategy(
        consistency="ssp", staleness=2, num_servers=2, chunk_bytes=256, cached_reads=True
    ),
    "asp-read-ahead": PSStrategy(consistency="asp", num_servers=2, chunk_bytes=256, read_ahead=True),
    "bsp-delta": PSStrategy(consistency="bsp", num_servers=2, chunk_bytes=256, update="delta"),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_staged_pushes_and_pulls_equal_the_plain_path_bit_for_bit(mode: str) -> None:
    staged, plain, sync = lockstep(MODES[mode], device="cpu", staged=PlainCopies())
    assert_equal_bitwise(staged, plain)
    assert sync.staging.active and not plain.push_pinned[0]
    ptrs = set(staged.push_ptrs)
    if mode.endswith("read-ahead"):  # every push asynchronous: two slots, alternating
        assert len(sync.staging.slots) == 2 and len(ptrs) == 2
        assert all(a != b for a, b in zip(staged.push_ptrs, staged.push_ptrs[1:]))
    elif mode.endswith("cached"):  # an asynchronous push, then a synchronous one, ...
        assert len(sync.staging.slots) == 2 and len(ptrs) == 2
    else:  # a synchronous push: one slot, reused every clock
        assert len(sync.staging.slots) == 1 and len(ptrs) == 1


@pytest.mark.parametrize("mode", ["ssp-plain", "ssp-cached", "asp-read-ahead"])
@pytest.mark.parametrize("accumulate", [1, 3])
def test_copies_during_backward_equal_the_plain_path_bit_for_bit(mode: str, accumulate: int) -> None:
    staged, plain, sync = lockstep(
        MODES[mode], device="cpu", staged=PlainCopies(), accumulate=accumulate, in_backward=True
    )
    assert_equal_bitwise(staged, plain)
    assert sync.staging._hooks == []  # (closed with the strategy)


def test_a_cpu_model_takes_the_pass_through_by_default() -> None:
    staged, plain, sync = lockstep(
        MODES["ssp-cached"], device="cpu", staged="auto", optimizer=SGDOptimizer(lr=0.1), clocks=3
    )
    assert_equal_bitwise(staged, plain)
    assert not sync.staging.active and sync.staging.slots == []
