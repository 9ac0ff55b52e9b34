"""Lock-step runs of two single-worker PS jobs, one staging its pushes and pulls through host
buffers and one on the plain path (``sync/ps_staging.py``), for the CPU tests
(``test_ps_staging_inproc.py``, plain copies) and the GPU test (``tests/gpu/test_gpu_ps_staging.py``,
pinned buffers and asynchronous copies).

Both workers hold the same model on ``device`` and push the same gradients (the staged worker's
backward passes, cloned into the plain one's ``.grad``: a device whose kernels are not
deterministic cannot make the comparison flaky); every push (as host tensors) and the weights
after every clock are recorded, so the two traces must be equal bit for bit."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flotilla.config.schema import PSStrategy, SGDOptimizer
from flotilla.ps.server import shard_config_from
from flotilla.sync.base import Proposal
from flotilla.sync.ps_settings import ps_config_from
from flotilla.sync.via_ps import PSSync
from tests.inproc.test_ps_server import FAST, _data, _model, _pssync, servers

GLOBAL_BATCH = 48


@dataclass
class Trace:
    """What one worker pushed (host copies, in order) and held after every clock."""

    pushed: list[dict[str, torch.Tensor]] = field(default_factory=list)
    weights: list[dict[str, torch.Tensor]] = field(default_factory=list)
    push_ptrs: list[tuple[int, ...]] = field(default_factory=list)  # the host tensors' addresses
    push_pinned: list[bool] = field(default_factory=list)  # every host tensor of the push pinned
    pull_ptrs: list[tuple[int, ...]] = field(default_factory=list)  # where each clock's pull landed


def _record(sync: PSSync, trace: Trace) -> None:
    """Wrap the client's push calls so that every push's values are recorded."""
    client = sync.client

    def log(values: Any) -> None:
        trace.pushed.append({n: t.detach().cpu().clone() for n, t in values.items()})
        trace.push_ptrs.append(tuple(t.data_ptr() for t in values.values()))
        trace.push_pinned.append(all(t.device.type == "cpu" and t.is_pinned() for t in values.values()))

    for name in ("push_async", "push_pull", "push_pull_ahead"):
        original = getattr(client, name)

        def wrapped(values: Any, *args: Any, _original: Any = original, **kw: Any) -> Any:
            log(values)
            return _original(values, *args, **kw)

        setattr(client, name, wrapped)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


@contextlib.contextmanager
def _worker(
    strategy: PSStrategy, optimizer: Any, model: nn.Module, copies: Any, in_backward: bool = False
) -> Iterator[PSSync]:
    ps = ps_config_from(strategy, optimizer)
    cfgs = [shard_config_from(ps, num_workers=1, shard_index=i) for i in range(ps.num_servers)]
    with servers(cfgs) as srvs:
        sync = _pssync(
            model,
            optimizer,
            strategy,
            [s.address for s in srvs],
            0,
            num_workers=1,
            options=FAST,
            host_copies=copies,
            copy_in_backward=in_backward,
        )
        try:
            yield sync
        finally:
            sync.close()


def lockstep(
    strategy: PSStrategy,
    *,
    device: str,
    staged: Any,
    optimizer: Any = None,
    clocks: int = 5,
    accumulate: int = 2,
    in_backward: bool = False,
) -> tuple[Trace, Trace, PSSync]:
    """Train ``clocks`` clocks of ``accumulate`` backward passes with a staged worker (host copies
    ``staged``; ``in_backward``: its gradients copied during backward) and a plain one (None);
    returns their traces and the staged worker (closed)."""
    optimizer = optimizer or SGDOptimizer(lr=0.1, momentum=0.5)
    x, y = (t.to(device) for t in _data())
    m_staged, m_plain = _model().to(device), _model().to(device)
    traces = Trace(), Trace()
    with (
        _worker(strategy, optimizer, m_staged, staged, in_backward) as a,
        _worker(strategy, optimizer, m_plain, None) as b,
    ):
        _record(a, traces[0])
        _record(b, traces[1])
        a.initialize(), b.initialize()
        gen = torch.Generator().manual_seed(7)
        for clock in range(clocks):
            a.begin_step(clock), b.begin_step(clock)
            idx = torch.randint(0, x.shape[0], (GLOBAL_BATCH,), generator=gen).to(device)
            for i, part in enumerate(idx.chunk(accumulate)):
                if accumulate > 1:
                    a.defer_reduction(i < accumulate - 1)
                out = m_staged(x[part])
                (nn.functional.cross_entropy(out, y[part], reduction="sum") / GLOBAL_BATCH).backward()
            for pa, pb in zip(m_staged.parameters(), m_plain.parameters()):
                pb.grad = None if pa.grad is None else pa.grad.clone()
            assert a.synchronize(Proposal()).committed and b.synchronize(Proposal()).committed
            for sync, trace, m in ((a, traces[0], m_staged), (b, traces[1], m_plain)):
                trace.weights.append(_weights(m))
                trace.pull_ptrs.append(tuple(t.data_ptr() for t in sync.staging.target().values()))
        a.refresh(a.clock), b.refresh(b.clock)  # the global weights at the end
        traces[0].weights.append(_weights(m_staged))
        traces[1].weights.append(_weights(m_plain))
    return traces[0], traces[1], a


def assert_equal_bitwise(got: Trace, want: Trace) -> None:
    """Every push and every clock's weights equal, bit for bit."""
    assert len(got.pushed) == len(want.pushed) > 0 and len(got.weights) == len(want.weights)
    for what, xs, ys in (("push", got.pushed, want.pushed), ("weights", got.weights, want.weights)):
        for k, (gx, wx) in enumerate(zip(xs, ys)):
            assert gx.keys() == wx.keys(), (what, k)
            for name in gx:
                assert gx[name].dtype == wx[name].dtype and torch.equal(gx[name], wx[name]), (what, k, name)
