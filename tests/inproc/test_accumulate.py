"""Gradient accumulation (``job.accumulate``, issue 36 item 3): a worker's share of every step in K
forward/backward passes gives the update of one pass over the whole share, within float
tolerance, under ``allreduce`` on real gloo groups (its buckets are reduced during backward: the
passes before the last must not start them, ``SyncStrategy.defer_reduction``), also when K does
not divide the local batch; and the configuration refuses what it cannot split."""

from __future__ import annotations

import threading

import pytest
import torch

from flotilla.comm.collective import EpochGroup
from flotilla.comm.store import StoreHost, connect_store
from flotilla.config import load_config
from flotilla.core.errors import ConfigError
from flotilla.sync.allreduce import BucketedAllReduce
from flotilla.trainer.step import Minibatch, run_unit

from ._replicas import make_data, make_model

STEPS = 6


def _train(num_workers: int, accumulate: int, batch: int) -> list[torch.Tensor]:
    host = StoreHost("127.0.0.1")
    x, y = make_data()
    final: dict[int, list[torch.Tensor]] = {}

    def worker(w: int) -> None:
        store = connect_store(host.address)
        group = EpochGroup(store, epoch=1, rank=w, world_size=num_workers, timeout_s=30.0)
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sync = BucketedAllReduce(model, bucket_bytes=256, optimizer=opt)
        sync.bind(group)
        try:
            for step in range(STEPS):
                idx = torch.arange(step * batch, (step + 1) * batch) % x.shape[0]
                mine = idx.tensor_split(num_workers)[w]
                res = run_unit(
                    model,
                    sync,
                    (Minibatch(step, x[mine], y[mine]),),
                    global_batch=batch,
                    accumulate=accumulate,
                )
                assert res.decision.committed, res.decision
            final[w] = [p.detach().clone() for p in model.parameters()]
        finally:
            sync.close()
            group.close()

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(num_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    host.close()
    assert len(final) == num_workers, "a replica failed"
    for w in range(1, num_workers):  # the replicas agree bit for bit
        assert all(torch.equal(a, b) for a, b in zip(final[0], final[w]))
    return final[0]


@pytest.mark.parametrize(("workers", "accumulate", "batch"), [(2, 4, 48), (2, 5, 24), (1, 4, 32), (3, 2, 36)])
def test_k_passes_give_the_update_of_one(workers: int, accumulate: int, batch: int) -> None:
    one = _train(workers, 1, batch)
    many = _train(workers, accumulate, batch)
    for a, b in zip(one, many):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    assert any(not torch.equal(a, b) for a, b in zip(one, many)) or workers == 1  # (really K passes)


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (["job.accumulate=3", "job.batch_size=64", "cluster.num_workers=2"], "job.accumulate: must divide"),
        (["job.accumulate=0"], "job.accumulate"),
    ],
)
def test_what_cannot_be_split_is_refused_naming_the_field(sets: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config("examples/tiny.yaml", sets)


def test_a_pipeline_refuses_accumulate_and_the_fingerprint_ignores_it() -> None:
    with pytest.raises(ConfigError, match="job.accumulate: cannot be used with strategy pipeline"):
        load_config("examples/pipeline_lm.yaml", ["job.accumulate=2"])
    base = load_config("examples/tiny.yaml", ["job.batch_size=64", "cluster.num_workers=2"])
    more = load_config(
        "examples/tiny.yaml", ["job.batch_size=64", "cluster.num_workers=2", "job.accumulate=4"]
    )
    assert base.fingerprint() == more.fingerprint()  # a checkpoint resumes with another K
