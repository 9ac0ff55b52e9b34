"""Which GPU each CUDA worker computes on (``cluster/gpu_placement.py``, issue 34): pure, so it
is tested here without a GPU."""

from __future__ import annotations

import pytest

from flotilla.cluster.gpu_placement import place_gpus


def test_cuda_workers_take_their_node_s_gpus_in_order_and_cpu_workers_none() -> None:
    workers = [("a", "n0", "cuda"), ("b", "n0", "cpu"), ("c", "n0", "cuda"), ("d", "n1", "cuda")]
    p = place_gpus(workers, gpus=2)
    assert p.index == {"a": 0, "c": 1, "d": 0}
    assert not p.shared and p.sharing_warning() == "" and p.backend == "gloo"  # (b is on the CPU)
    assert place_gpus([w for w in workers if w[2] == "cuda"], gpus=2).backend == "nccl"


def test_more_cuda_workers_than_gpus_share_them_over_gloo_with_a_warning() -> None:
    p = place_gpus([("w0", "local", "cuda"), ("w1", "local", "cuda"), ("w2", "local", "cuda")], gpus=2)
    assert p.index == {"w0": 0, "w1": 1, "w2": 0}
    assert p.shared == {"local": ("w0", "w1", "w2")} and p.backend == "gloo"
    warning = p.sharing_warning()
    assert "['w0', 'w1', 'w2']" in warning and "2 per host" in warning and "gloo" in warning


def test_no_cuda_worker_means_no_nccl_and_no_gpu_means_an_error() -> None:
    assert place_gpus([("w0", "local", "cpu")], gpus=1).backend == "gloo"
    with pytest.raises(ValueError, match="at least one GPU"):
        place_gpus([("w0", "local", "cuda")], gpus=0)


def test_an_out_of_memory_error_becomes_one_line_naming_the_worker_and_the_device() -> None:
    import torch

    from flotilla.trainer.builders import out_of_memory

    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    err = out_of_memory("stage 1 ('slow')", torch.device("cpu"), exc)
    assert str(err).startswith("stage 1 ('slow') ran out of memory on cpu: CUDA out of memory. Tried")
    assert "\n" not in str(err) and "job.batch_size" in str(err)


def test_a_cpu_worker_or_a_possible_joiner_means_gloo_for_the_whole_job() -> None:
    mixed = place_gpus([("fast", "local", "cuda"), ("slow", "local", "cpu")], gpus=1)
    assert mixed.index == {"fast": 0} and not mixed.shared and mixed.backend == "gloo"
    joiners = place_gpus([("w0", "local", "cuda"), ("w1", "local", "cuda")], gpus=2, joiners=True)
    assert joiners.index == {"w0": 0, "w1": 1} and joiners.backend == "gloo"


def test_flotilla_run_places_every_worker_on_its_one_machine_whatever_their_node_labels() -> None:
    workers = [("a", "n1", "cuda"), ("b", "n2", "cuda")]
    assert place_gpus(workers, gpus=2).index == {"a": 0, "b": 0}  # (roles started by hand: per host)
    one = place_gpus(workers, gpus=2, one_host=True)
    assert one.index == {"a": 0, "b": 1} and one.backend == "nccl"
    assert place_gpus(workers, gpus=1, one_host=True).shared == {"local": ("a", "b")}
