"""PS pushes and pulls on CUDA through pinned host buffers with asynchronous copies
(``sync/ps_staging.py``; issue 34, item 1; skipped without CUDA: see conftest.py).

- On in-process servers, a CUDA worker whose pushes and pulls are staged and one on the plain path
  (the codec's ``.cpu()``, synchronous copies into the parameters) push the same values and hold
  the same weights after every clock, bit for bit -- under SSP with two shards (chunks across
  them), with cached reads and with read-ahead (asynchronous pushes from the client's threads),
  with the ``delta`` rule, and with the gradients copied during backward;
- the staged host tensors are pinned, allocated once and reused (the same addresses every clock:
  one slot for a synchronous push, two alternating for an asynchronous one), and the pulls land
  in the same pinned buffers every clock;
- ``examples/tiny.yaml`` under ``ps`` with SSP on cuda reaches the target of the other strategies'
  GPU test, and every worker logs that it staged its traffic through pinned buffers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.config.schema import PSStrategy
from flotilla.sync.ps_staging import CudaCopies
from tests.inproc._ps_staging import assert_equal_bitwise, lockstep

from ..multiproc._jobs import run_summary
from .test_gpu_strategies import STRATEGIES

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

MODES = {
    "ssp": PSStrategy(consistency="ssp", staleness=2, num_servers=2, chunk_bytes=256),
    "ssp-cached": PSStrategy(
        consistency="ssp", staleness=2, num_servers=2, chunk_bytes=256, cached_reads=True
    ),
    "asp-read-ahead": PSStrategy(consistency="asp", num_servers=2, chunk_bytes=256, read_ahead=True),
    "bsp-delta": PSStrategy(consistency="bsp", num_servers=2, chunk_bytes=256, update="delta"),
}
ASYNC = ("ssp-cached", "asp-read-ahead")


@pytest.mark.parametrize("in_backward", [False, True], ids=["at-push", "in-backward"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_staged_pushes_and_pulls_on_cuda_equal_the_plain_path_bit_for_bit(
    mode: str, in_backward: bool
) -> None:
    staged, plain, sync = lockstep(MODES[mode], device="cuda", staged="auto", in_backward=in_backward)
    assert isinstance(sync.staging.copies, CudaCopies)
    assert_equal_bitwise(staged, plain)
    assert not any(plain.push_pinned)  # (the plain path pushed the CUDA gradients themselves)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_host_buffers_are_pinned_and_reused_every_clock(mode: str) -> None:
    staged, _, sync = lockstep(MODES[mode], device="cuda", staged="auto", clocks=6)
    assert all(staged.push_pinned), staged.push_pinned
    slots = sync.staging.slots
    assert all(t.is_pinned() for slot in slots for t in slot.values())
    assert len(slots) == (2 if mode in ASYNC else 1)
    assert len(set(staged.push_ptrs)) == len(slots)  # allocated once, reused
    slot_ptrs = {tuple(t.data_ptr() for t in slot.values()) for slot in slots}
    assert set(staged.push_ptrs) == slot_ptrs
    if mode == "asp-read-ahead":
        assert all(a != b for a, b in zip(staged.push_ptrs, staged.push_ptrs[1:]))
    assert len(set(staged.pull_ptrs)) == 1  # every clock's pull landed in the same buffers
    assert all(t.is_pinned() for t in sync.staging.target().values())


def test_tiny_trains_under_ps_ssp_on_cuda_through_pinned_buffers(tmp_path: Path) -> None:
    sets = ("cluster.defaults.device=cuda", "job.steps=60", *STRATEGIES["ps"])
    summary = run_summary("examples/tiny.yaml", tmp_path, *sets)
    print("ps ssp staged: test accuracy", summary["test_accuracy"])
    assert summary["completed"] and summary["strategy"] == "ps"
    assert summary["test_accuracy"] >= 0.9
    workers = summary["workers"]
    assert workers and all(str(w.get("device", "")).startswith("cuda") for w in workers)
    staged = [
        line
        for f in (tmp_path / "run").rglob("*.log")
        for line in f.read_text(errors="replace").splitlines()
        if "staged through pinned host buffers" in line
    ]
    assert len(staged) >= len(workers), staged
