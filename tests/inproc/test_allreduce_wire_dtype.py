"""``strategy: {kind: allreduce, grad_dtype: bf16}``: the buckets travel as bfloat16 (half the
bytes), the replicas stay bitwise identical, and the update is float32's to bfloat16's precision."""

from __future__ import annotations

import threading

import pytest
import torch

from flotilla.comm.collective import EpochGroup
from flotilla.comm.store import StoreHost, connect_store
from flotilla.config.load import validate_config
from flotilla.core.errors import ConfigError
from flotilla.sync.allreduce import BucketedAllReduce
from flotilla.sync.allreduce_settings import AllReduceStrategy
from flotilla.trainer.step import run_step
from tests.inproc._replicas import make_data, make_model, run_replicas


def test_bf16_on_the_wire_keeps_the_replicas_identical_every_step() -> None:
    res = run_replicas(3, 10, wire_dtype=torch.bfloat16)
    assert not res["errors"]
    for step in range(10):
        assert len({res["log"][w][step][2] for w in range(3)}) == 1, f"replicas diverged at step {step}"
    plain = run_replicas(3, 10)
    assert res["final"][0][1] != plain["final"][0][1]  # (the sums really travelled as bfloat16)


def _one_step(wire_dtype: torch.dtype | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One step of 2 replicas on an uneven split; the reduced gradients and the bucket dtypes."""
    x, y = make_data()
    host = StoreHost()
    grads: dict[int, list[torch.Tensor]] = {}
    wires: list[torch.Tensor] = []

    def worker(w: int) -> None:
        group = EpochGroup(connect_store(host.address), epoch=1, rank=w, world_size=2)
        model = make_model()
        sync = BucketedAllReduce(model, bucket_bytes=300, optimizer=None, wire_dtype=wire_dtype)
        sync.bind(group)
        sl = slice(0, 10) if w == 0 else slice(10, 24)
        run_step(model, sync, x[sl], y[sl], step=0, global_batch=24)
        sync.write_back()
        grads[w] = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
        if w == 0:
            wires.extend(b.wire for b in sync._buckets if b.wire is not None)
        sync.close()
        group.close()

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    host.close()
    for a, b in zip(grads[0], grads[1], strict=True):
        assert torch.equal(a, b)
    return grads[0], wires


def test_bf16_gradients_are_the_float32_ones_to_bfloat16_precision() -> None:
    exact, no_wire = _one_step(None)
    assert not no_wire
    cast, wires = _one_step(torch.bfloat16)
    assert wires and all(w.dtype == torch.bfloat16 for w in wires)
    assert any(not torch.equal(a, b) for a, b in zip(exact, cast, strict=True))
    for a, b in zip(exact, cast, strict=True):
        assert b.dtype == torch.float32
        # (bfloat16: 8 bits of mantissa; two roundings, and sums of opposite signs cancel)
        torch.testing.assert_close(b, a, rtol=2**-6, atol=2**-7 * float(a.abs().max()))


def test_grad_dtype_is_a_setting_of_allreduce_with_a_named_error() -> None:
    base = {
        "cluster": {"num_workers": 2},
        "job": {
            "model": {"name": "tiny_mlp"},
            "dataset": {"name": "synthetic", "num_samples": 200},
            "steps": 5,
        },
    }
    cfg = validate_config({**base, "strategy": {"kind": "allreduce", "grad_dtype": "bf16"}})
    assert isinstance(cfg.strategy, AllReduceStrategy) and cfg.strategy.package().grad_dtype == "bf16"
    with pytest.raises(ConfigError) as err:
        validate_config({**base, "strategy": {"kind": "allreduce", "grad_dtype": "fp8"}})
    assert "grad_dtype" in str(err.value)
