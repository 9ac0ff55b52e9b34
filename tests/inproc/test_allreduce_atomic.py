"""Atomic step and bitwise-identical replicas on real gloo groups (threads in one process)."""

from __future__ import annotations

import pytest
import torch

from flotilla.core.faults import Fault, FaultPlan
from flotilla.sync.allreduce import plan_buckets

from ._replicas import make_data, make_model, run_replicas


def test_plan_buckets_respects_cap_and_order() -> None:
    assert plan_buckets([100, 100, 100, 500, 10], 250) == [[0, 1, 2], [3], [4]]
    assert plan_buckets([10, 10, 10], 1000) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([1], 0)


def test_replicas_bitwise_identical_every_step() -> None:
    res = run_replicas(3, 12)
    assert not res["errors"]
    logs = res["log"]
    for step in range(12):
        digests = {logs[w][step][2] for w in range(3)}
        assert len(digests) == 1, f"replicas diverged at step {step}"
        assert all(logs[w][step][1] for w in range(3))
    assert len({res["final"][w][1] for w in range(3)}) == 1


def test_distributed_gradient_matches_single_process() -> None:
    """Same global batch split over 2 workers == one process on the whole batch (to rounding)."""
    import threading

    from flotilla.comm.collective import EpochGroup
    from flotilla.comm.store import StoreHost, connect_store
    from flotilla.sync.allreduce import BucketedAllReduce
    from flotilla.trainer.step import run_step

    x, y = make_data()
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.nn.functional.cross_entropy(ref(x[:24]), y[:24]).backward()
    opt.step()
    host = StoreHost()
    params = {}

    def worker(w: int) -> None:
        group = EpochGroup(connect_store(host.address), epoch=1, rank=w, world_size=2)
        model = make_model()
        o = torch.optim.SGD(model.parameters(), lr=0.1)
        sync = BucketedAllReduce(model, bucket_bytes=300, optimizer=o)
        sync.bind(group)
        sl = slice(0, 10) if w == 0 else slice(10, 24)  # uneven split on purpose
        run_step(model, sync, x[sl], y[sl], step=0, global_batch=24)
        params[w] = [p.detach().clone() for p in model.parameters()]
        group.close()

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    for a, b, r in zip(params[0], params[1], ref.parameters()):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, r.detach(), rtol=1e-5, atol=1e-6)


def test_injected_failure_mid_step_is_applied_nowhere_and_redone() -> None:
    # worker 1's part of step 5 fails once (a fault fires once: the redo succeeds)
    plan = FaultPlan((Fault(worker="1", step=5, phase="sync", action="fail"),))
    clean = run_replicas(3, 10)
    faulty = run_replicas(3, 10, plan=plan)
    for w in range(3):
        log = faulty["log"][w]
        # step 5 appears twice: first discarded (digest unchanged from step 4), then redone
        aborted = [e for e in log if not e[1]]
        assert [e[0] for e in aborted] == [5]
        idx = log.index(aborted[0])
        assert log[idx][2] == log[idx - 1][2], "a discarded step changed the parameters"
    # redo rule: the faulty run ends bitwise equal to the fault-free run
    assert {faulty["final"][w] for w in range(3)} == {clean["final"][0]}


def test_injected_failure_with_drop_rule_skips_the_step_everywhere() -> None:
    plan = FaultPlan((Fault(worker="0", step=3, phase="sync", action="fail"),))  # never retried
    res = run_replicas(2, 6, plan=plan, on_abort="drop")
    assert len({res["final"][w] for w in range(2)}) == 1
    for w in range(2):
        log = res["log"][w]
        assert [e[0] for e in log if not e[1]] == [3]
        assert len(log) == 6
        assert log[3][2] == log[2][2], "the dropped step changed the parameters"


def test_replica_dying_mid_step_leaves_survivors_unchanged() -> None:
    res = run_replicas(3, 8, die=(2, 4), timeout_s=2.0)
    assert res["errors"][2] == "died"
    before = {res["log"][w][3][2] for w in (0, 1)}
    assert len(before) == 1
    for w in (0, 1):
        step, committed, digest = res["log"][w][-1]
        assert step == 4 and not committed
        assert digest in before, "survivor applied part of the failed step"
        assert res["final"][w][0] == 4


def test_a_group_aborted_before_backward_is_a_broken_step_not_an_exception() -> None:
    """The coordinator's broken-epoch notice may abort the group before backward launches its first
    bucket (inside the gradient hook): the step comes back as data (broken, nothing applied)."""
    import threading

    from flotilla.comm.collective import EpochGroup
    from flotilla.comm.store import StoreHost, connect_store
    from flotilla.sync.allreduce import BucketedAllReduce
    from flotilla.sync.state import model_digest
    from flotilla.trainer.step import run_step

    x, y = make_data()
    host = StoreHost()
    out: dict = {}
    ready = threading.Barrier(2, timeout=60)

    def worker(w: int) -> None:
        group = EpochGroup(connect_store(host.address), epoch=1, rank=w, world_size=2)
        model = make_model()
        sync = BucketedAllReduce(
            model, bucket_bytes=300, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
        )
        sync.bind(group)
        sl = slice(0, 4) if w == 0 else slice(4, 8)
        first = run_step(model, sync, x[sl], y[sl], step=0, global_batch=8).decision.committed
        before = model_digest(model)
        ready.wait()
        group.abort("epoch 1 is broken (a member died)")
        res = run_step(model, sync, x[sl], y[sl], step=1, global_batch=8)
        out[w] = (
            first,
            res.decision.broken,
            res.decision.committed,
            res.decision.reason,
            before == model_digest(model),
        )
        group.close()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        host.close()
    for w in range(2):
        first, broken, committed, reason, unchanged = out[w]
        assert first and broken and not committed and unchanged, out[w]
        assert "broken" in reason


def test_one_member_view_trains_exactly_like_plain_torch() -> None:
    """A one-member view skips buckets and collectives (solo path): the weights after a few steps
    equal plain torch's bit for bit (same loss scaling, momentum, an unused parameter included)."""
    from flotilla.comm.collective import EpochGroup
    from flotilla.comm.store import StoreHost, connect_store
    from flotilla.sync.allreduce import BucketedAllReduce
    from flotilla.trainer.step import run_step

    x, y = make_data()
    model, ref = make_model(), make_model()
    unused = torch.nn.Parameter(torch.ones(3))
    model.register_parameter("unused", unused)
    ref.register_parameter("unused", torch.nn.Parameter(torch.ones(3)))
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    host = StoreHost()
    try:
        group = EpochGroup(connect_store(host.address), epoch=1, rank=0, world_size=1)
        sync = BucketedAllReduce(model, bucket_bytes=300, optimizer=opt)
        sync.bind(group)
        for k in range(3):
            sl = slice(8 * k, 8 * k + 8)
            assert run_step(model, sync, x[sl], y[sl], step=k, global_batch=8).decision.committed
            ref_opt.zero_grad(set_to_none=True)
            (torch.nn.functional.cross_entropy(ref(x[sl]), y[sl], reduction="sum") / 8).backward()
            for p in ref.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            ref_opt.step()
        group.close()
    finally:
        host.close()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_one_member_with_a_fused_optimizer_skips_a_non_finite_step_on_the_device() -> None:
    """Issue 34: with a fused Adam/AdamW (what CUDA parameters get) the solo path hands the
    non-finite flag to the optimizer's step instead of reading it first (``guards_on_device``).
    Run here on the CPU's fused kernel: the weights equal plain torch's with the same optimizer
    bit for bit, and a step with a NaN gradient (its loss finite, so the flag decides) changes
    nothing -- weights, moments and the step count -- and is discarded as non-finite."""
    from flotilla.comm.collective import EpochGroup
    from flotilla.comm.store import StoreHost, connect_store
    from flotilla.sync.allreduce import BucketedAllReduce
    from flotilla.sync.state import guards_on_device
    from flotilla.trainer.step import Minibatch, TaskLoss, run_unit

    x, y = make_data()
    model, ref = make_model(), make_model()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, fused=True)
    assert guards_on_device(opt, list(model.parameters()))
    poison = {"on": False}
    first = next(model.parameters())
    first.register_hook(lambda g: torch.full_like(g, float("nan")) if poison["on"] else g)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out, target)

    host = StoreHost()
    try:
        group = EpochGroup(connect_store(host.address), epoch=1, rank=0, world_size=1)
        sync = BucketedAllReduce(model, bucket_bytes=300, optimizer=opt)
        sync.bind(group)
        assert sync.checks_loss_on_device
        for k in range(4):
            sl = slice(8 * k, 8 * k + 8)
            poison["on"] = k == 2
            before = {n: t.clone() for n, t in model.state_dict().items()}
            steps_before = [float(s["step"]) for s in opt.state.values()]
            res = run_unit(
                model, sync, (Minibatch(k, x[sl], y[sl]),), global_batch=8, loss_fn=TaskLoss(loss, False)
            )
            if k == 2:
                assert not res.decision.committed and not res.decision.local_ok and res.nonfinite == ""
                assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
                assert [float(s["step"]) for s in opt.state.values()] == steps_before
                continue
            assert res.decision.committed and res.nonfinite == "" and res.loss == res.loss
            ref_opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(ref(x[sl]), y[sl]).backward()
            ref_opt.step()
        group.close()
    finally:
        host.close()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert [float(s["step"]) for s in opt.state.values()] == [3.0] * len(opt.state)
