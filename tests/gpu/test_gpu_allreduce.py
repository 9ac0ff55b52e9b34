"""The collective plane and an all-reduce run on CUDA (skipped without CUDA: see conftest.py).

NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected"), so the
two-rank NCCL test needs two GPUs; on one GPU a one-rank NCCL group still exercises the backend, and
gloo reduces CUDA tensors between two ranks sharing the device.  The ``flotilla run`` tests train
``examples/tiny.yaml`` with ``cluster.defaults.type=cuda`` to the target the CPU runs reach (test
accuracy >= 0.9, as in tests/multiproc/test_ps_run.py).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from flotilla.comm.collective import EpochGroup
from flotilla.comm.store import StoreHost, connect_store

from ..multiproc._jobs import processes_mentioning, start, stop

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def _reduce_in_threads(backend: str, devices: list[str], n: int = 1 << 20) -> list[torch.Tensor]:
    """Every rank (a thread) all-reduces ``rank + 1`` filled tensors on its device; the results."""
    host = StoreHost("127.0.0.1")
    results: list[torch.Tensor | None] = [None] * len(devices)
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        group = None
        try:
            torch.cuda.set_device(torch.device(devices[rank]))
            store = connect_store(host.address)
            group = EpochGroup(
                store, epoch=1, rank=rank, world_size=len(devices), timeout_s=60, backend=backend
            )
            t = torch.full((n,), float(rank + 1), device=devices[rank])
            group.allreduce(t)
            torch.cuda.synchronize(devices[rank])
            results[rank] = t.cpu()
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
        finally:
            if group is not None:
                group.close()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(len(devices))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "an all-reduce rank hung"
    finally:
        host.close()
    assert not errors, errors
    return [r for r in results if r is not None]


def test_nccl_allreduce_between_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank (it refuses two ranks on one device); this machine has 1")
    out = _reduce_in_threads("nccl", ["cuda:0", "cuda:1"])
    assert len(out) == 2 and all(torch.equal(t, torch.full_like(t, 3.0)) for t in out)


def test_a_one_rank_nccl_group_reduces_on_the_gpu() -> None:
    (out,) = _reduce_in_threads("nccl", ["cuda:0"])
    assert torch.equal(out, torch.full_like(out, 1.0))


def test_gloo_reduces_cuda_tensors_of_two_ranks_sharing_one_gpu() -> None:
    out = _reduce_in_threads("gloo", ["cuda:0", "cuda:0"], n=4096)
    assert len(out) == 2 and all(torch.equal(t, torch.full_like(t, 3.0)) for t in out)


@pytest.mark.parametrize("workers", [1, 2])
def test_tiny_allreduce_run_on_cuda_reaches_the_target(tmp_path: Path, workers: int) -> None:
    args = [
        "run",
        "examples/tiny.yaml",
        "--report",
        str(tmp_path / "report"),
        "--run-dir",
        str(tmp_path / "run"),
        "--no-progress",
        "--set",
        "cluster.defaults.type=cuda",
        "--set",
        f"cluster.num_workers={workers}",
        "--set",
        "job.steps=60",
    ]
    proc = start(args, tmp_path / "launcher.log")
    try:
        assert proc.wait(timeout=280) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    finally:
        stop(proc)
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["completed"] and summary["strategy"] == "allreduce"
    assert summary["num_workers"] == workers
    assert summary["test_accuracy"] >= 0.9
    assert processes_mentioning(str(tmp_path)) == []
