"""``job.precision: bf16`` and ``job.compile`` (trainer/precision.py, issue 34), once per engine
kind on a tiny model, on the CPU (bf16 autocast and the ``aot_eager`` backend run there):

- the replica engine's step (``run_unit``, what every coordinated strategy runs): under bf16 the
  layers compute in bfloat16 while parameters, gradients and the optimizer stay float32, and it
  trains; compiled, it trains exactly as uncompiled and keeps its ``state_dict`` keys;
- the pipeline stage runtime (two stages on a real gloo group): under bf16 the activations
  travel in the boundary's float32 and the gradients stay close to float32 training's;
  compiled stages give the single-process gradients.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flotilla.comm.collective import EpochGroup
from flotilla.comm.store import StoreHost, connect_store
from flotilla.pipeline.schedule import ScheduleKind
from flotilla.sync.allreduce import BucketedAllReduce
from flotilla.trainer.precision import autocast_of, compile_model
from flotilla.trainer.step import Minibatch, TaskLoss, run_unit

from ._replicas import make_data, make_model
from .test_pipeline_correctness import _cat_stages, _model, _reference_grads, run_threads


def _train(model: nn.Module, steps: int, autocast=None) -> list[float]:
    """``steps`` steps of one member's allreduce with SGD; the losses."""
    x, y = make_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    host = StoreHost()
    losses = []
    try:
        group = EpochGroup(connect_store(host.address), epoch=1, rank=0, world_size=1)
        sync = BucketedAllReduce(model, bucket_bytes=1 << 20, optimizer=opt)
        sync.bind(group)
        loss = TaskLoss(nn.functional.cross_entropy, sums=False)
        for k in range(steps):
            sl = slice(16 * k, 16 * k + 16)
            kw = {} if autocast is None else {"autocast": autocast}
            res = run_unit(model, sync, (Minibatch(k, x[sl], y[sl]),), global_batch=16, loss_fn=loss, **kw)
            assert res.decision.committed
            losses.append(res.loss)
        group.close()
    finally:
        host.close()
    return losses


def test_bf16_computes_the_layers_in_bfloat16_and_keeps_weights_and_gradients_float32() -> None:
    model, seen = make_model(), []
    model.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    bf16 = _train(model, 25, autocast_of("bf16", torch.device("cpu")))
    fp32 = _train(make_model(), 25)
    assert set(seen) == {torch.bfloat16}
    assert all(
        p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
        for p in model.parameters()
    )
    assert bf16 != fp32  # (really in bfloat16) ...
    assert abs(bf16[0] - fp32[0]) < 0.02 * fp32[0]  # ... and close to float32
    assert sum(bf16[-5:]) < 0.6 * sum(bf16[:5])  # and it trains


def test_a_compiled_replica_trains_as_the_uncompiled_one_and_keeps_its_state_dict_keys() -> None:
    compiled = make_model()
    keys = list(compiled.state_dict())
    compile_model(compiled, True, "aot_eager")
    assert compiled._compiled_call_impl is not None and list(compiled.state_dict()) == keys
    torch.testing.assert_close(_train(compiled, 4), _train(make_model(), 4), rtol=1e-6, atol=1e-7)
    for a, b in zip(compiled.parameters(), make_model().parameters()):
        assert not torch.equal(a, b)  # (it did train)


def test_bf16_stages_send_float32_activations_and_stay_close_to_float32_gradients() -> None:
    run = run_threads(
        ScheduleKind.ONE_F_ONE_B,
        (2, 6),
        4,
        2,
        model=lambda: _model().float(),
        autocast=autocast_of("bf16", torch.device("cpu")),
    )
    ref, _ = _reference_grads(run["x"], run["y"], 2, build=lambda: _model().float())
    got = _cat_stages({i: g[0] for i, g in run["grads"].items()})
    assert all(g.dtype == torch.float32 for g in got)
    num = sum(float((a - b).norm() ** 2) for a, b in zip(got, ref[0])) ** 0.5
    den = sum(float(b.norm() ** 2) for b in ref[0]) ** 0.5
    assert 0 < num / den < 0.05, num / den  # bf16's rounding, not another computation


def test_compiled_stages_give_the_single_process_gradients() -> None:
    run = run_threads(
        ScheduleKind.ONE_F_ONE_B, (2, 6), 4, 2, prepare=lambda m: compile_model(m, True, "aot_eager")
    )
    ref, params = _reference_grads(run["x"], run["y"], 2)
    for k in range(2):
        for a, b in zip(_cat_stages({i: g[k] for i, g in run["grads"].items()}), ref[k]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-12)
    for a, b in zip(_cat_stages(run["params"]), params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-12)


# ---------------------------------------------------------------------- fp16 with a loss scaler
def _fp16_replicas(num_steps: int, *, inf_at: tuple[int, int] | None = None, init_scale: float = 2.0**16):
    """Two allreduce replicas (threads, a real gloo group) train ``num_steps`` steps in fp16 with
    Adam; ``inf_at=(worker, step)``: a hook makes that worker's gradient infinite at that step.
    Per worker: [(step, committed, overflow, scale it ran with, reason, digest)], final scale."""
    import threading

    from flotilla.sync.loss_scale import ScaleRule
    from flotilla.sync.state import model_digest
    from flotilla.trainer.boundary import BoundaryPolicy, LoopState, UnitReport, decide
    from flotilla.trainer.precision import loss_scaler_of
    from flotilla.trainer.replica import attach_scaler

    host, (x, y), batch = StoreHost(), make_data(), 32
    out: dict = {w: [] for w in range(2)}
    policy = BoundaryPolicy(total_steps=num_steps, on_nonfinite="stop")

    def worker(w: int) -> None:
        group = EpochGroup(connect_store(host.address), epoch=1, rank=w, world_size=2, timeout_s=20)
        model = make_model()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        sync = BucketedAllReduce(model, bucket_bytes=256, optimizer=opt)
        sync.bind(group)
        scaler = loss_scaler_of("fp16", ScaleRule(init_scale=init_scale, growth_interval=3))
        attach_scaler(sync, scaler)
        state, step = LoopState(), [0]
        if inf_at is not None and inf_at[0] == w:
            model[0].weight.register_hook(lambda g: g.fill_(math.inf) if step[0] == inf_at[1] else g)
        loss = TaskLoss(nn.functional.cross_entropy, sums=False)
        try:
            for k in range(num_steps):
                step[0] = k
                idx = torch.arange(k * batch, (k + 1) * batch) % x.shape[0]
                mine = idx.tensor_split(2)[w]
                res = run_unit(
                    model, sync, (Minibatch(k, x[mine], y[mine]),), global_batch=batch, loss_fn=loss,
                    autocast=autocast_of("fp16", torch.device("cpu")), scaler=scaler,
                )  # fmt: skip
                d = res.decision
                report = UnitReport(
                    first_step=k, last_step=k, rank=w, epoch=1, committed=d.committed,
                    local_ok=d.local_ok, overflow=res.overflow,
                )  # fmt: skip
                b = decide(policy, state, report)
                assert b.stop is None or k == num_steps - 1, b  # (an overflow never stops the job)
                state = b.state
                out[w].append((k, d.committed, res.overflow, res.loss_scale, d.reason, model_digest(model)))
            out[w].append((scaler.state, state))
        finally:
            sync.close()
            group.close()

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    host.close()
    assert not any(t.is_alive() for t in threads), "replica threads hung"
    return out


def test_fp16_allreduce_replicas_stay_bitwise_identical_and_an_overflow_is_skipped_on_both() -> None:
    out = _fp16_replicas(12, inf_at=(1, 4))
    a, b = out[0], out[1]
    assert a == b  # the same commits, overflows, scales and digests on both replicas, every step
    steps = a[:-1]
    scales = [s[3] for s in steps]
    assert scales[:5] == [2.0**16, 2.0**16, 2.0**16, 2.0**17, 2.0**17]  # grew after 3 good steps
    k, committed, overflow, _, reason, digest = steps[4]
    assert not committed and overflow and "overflow" in reason
    assert digest == steps[3][5]  # nothing of the skipped step was applied
    assert scales[5] == 2.0**16  # halved at the overflow, on both
    assert all(s[1] and not s[2] for i, s in enumerate(steps) if i != 4)
    _scale, loop = a[-1]
    assert loop.nonfinite_skipped == 0 and loop.overflow_skipped == 1 and loop.step == 12
    assert steps[-1][5] != steps[0][5]


def test_fp16_a_huge_initial_scale_backs_off_until_it_fits_and_then_trains() -> None:
    out = _fp16_replicas(16, init_scale=2.0**24)
    steps = out[0][:-1]
    assert out[0] == out[1]
    overflows = [s for s in steps if s[2]]
    assert overflows and overflows == [s for s in steps if not s[1]]  # every skip an overflow
    assert sum(s[1] for s in steps) >= 5 and steps[-1][3] < 2.0**24  # (backed off, then trained)
    assert out[0][-1][1].nonfinite_skipped == 0
