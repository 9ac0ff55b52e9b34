"""The collective plane and an all-reduce run on CUDA (skipped without CUDA: see conftest.py).

NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected"), so the
two-rank NCCL test needs two GPUs; on one GPU a one-rank NCCL group still exercises the backend, and
gloo reduces CUDA tensors between two ranks sharing the device.  The ``flotilla run`` tests train
``examples/tiny.yaml`` with ``cluster.defaults.type=cuda`` to the target the CPU runs reach (test
accuracy >= 0.9, as in tests/multiproc/test_ps_run.py).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from flotilla.comm.collective import EpochGroup
from flotilla.comm.store import StoreHost, connect_store

from ..multiproc._jobs import run_summary

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


def test_a_one_rank_group_on_nccl_needs_its_device_and_reduces_on_the_gpu() -> None:
    """A one-member ``Group`` runs no backend (its collectives are the identity); the API still
    refuses NCCL without a CUDA device (the test of issue 34's report passed none)."""
    host = StoreHost("127.0.0.1")
    try:
        store = connect_store(host.address)
        with pytest.raises(ValueError, match="needs a cuda device"):
            EpochGroup(store, epoch=1, rank=0, world_size=1, backend="nccl")
        group = EpochGroup(
            store, epoch=2, rank=0, world_size=1, backend="nccl", device=torch.device("cuda:0")
        )
        t = torch.full((1024,), 3.0, device="cuda:0")
        group.allreduce(t)
        assert torch.equal(t.cpu(), torch.full((1024,), 3.0))
        group.close()
    finally:
        host.close()


def test_a_one_rank_nccl_communicator_is_aborted_and_re_created() -> None:
    """A real one-rank NCCL communicator, built as ``Group`` builds one (``_backend_maker``),
    reduces a CUDA tensor, is aborted as ``Group.close`` aborts it, and a new one works after it."""
    from torch import distributed as dist

    from flotilla.comm.collective import _backend_maker, abort_nccl

    host = StoreHost("127.0.0.1")
    try:
        store = connect_store(host.address)
        torch.cuda.set_device(0)
        for attempt in range(2):
            prefixed = dist.PrefixStore(f"nccl-test/{attempt}/", store)
            pg = _backend_maker("nccl", store, prefixed, 0, 1, 60.0)()
            t = torch.full((1 << 16,), float(attempt + 2), device="cuda:0")
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            pg.allreduce([t], opts).wait()
            torch.cuda.synchronize()
            assert torch.equal(t.cpu(), torch.full((1 << 16,), float(attempt + 2)))
            abort_nccl(pg)
            del pg
    finally:
        host.close()


def test_gloo_reduces_cuda_tensors_of_two_ranks_sharing_one_gpu() -> None:
    out = _reduce_in_threads("gloo", ["cuda:0", "cuda:0"], n=4096)
    assert len(out) == 2 and all(torch.equal(t, torch.full_like(t, 3.0)) for t in out)


@pytest.mark.parametrize("workers", [1, 2])
def test_tiny_allreduce_run_on_cuda_reaches_the_target(tmp_path: Path, workers: int) -> None:
    sets = ("cluster.defaults.type=cuda", f"cluster.num_workers={workers}", "job.steps=60")
    summary = run_summary("examples/tiny.yaml", tmp_path, *sets)
    assert summary["completed"] and summary["strategy"] == "allreduce"
    assert summary["num_workers"] == workers
    assert summary["test_accuracy"] >= 0.9


def test_a_killed_cuda_worker_is_left_behind_and_the_others_finish(tmp_path: Path) -> None:
    """``allreduce`` on cuda with three workers sharing the GPU (gloo); w2 is SIGKILLed at step
    20 by the revocation schedule; the other two train on to the target."""
    summary = run_summary(
        "examples/tiny.yaml",
        tmp_path,
        "cluster.defaults.device=cuda",
        "cluster.num_workers=3",
        "job.steps=80",
        "cluster.revocations={events: [{at_step: 20, action: kill, worker: w2}]}",
    )
    print("after the kill:", summary["num_workers"], "workers, accuracy", summary["test_accuracy"])
    assert summary["completed"] and summary["num_workers"] == 2 and summary["num_workers_started"] == 3
    assert summary["test_accuracy"] >= 0.9
    assert all(str(w.get("device", "")).startswith("cuda") for w in summary["workers"])
