"""The PS ``delta`` update rule (``ps/config.DeltaUpdate``, ``sync/via_ps``): a clock moves the
global weights by the MEAN of the workers' updates, so the learning rate means what it means
under ``allreduce``.  Three workers (threads) on in-process servers under BSP:

- SGD with momentum, weight decay and Nesterov, on an UNEVEN split of each global batch: the
  global weights follow ``torch.optim.SGD`` on the global-batch mean gradient (every term is
  linear in the gradient, so this is exact up to float rounding);
- Adam with every worker seeing the same samples: one clock is one Adam step, not three.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from flotilla.ps.config import DeltaUpdate, PSConfig
from flotilla.ps.consistency import BSP
from flotilla.ps.server import shard_config_from
from flotilla.sync.via_ps import PSSync
from tests.inproc.test_ps_server import FAST, SECRET, servers

pytestmark = pytest.mark.timeout(90)
NUM_WORKERS, GLOBAL_BATCH, CLOCKS = 3, 48, 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(GLOBAL_BATCH * CLOCKS, 5, generator=g), torch.randint(
        0, 3, (GLOBAL_BATCH * CLOCKS,), generator=g
    )


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss as the worker loop scales it: the sum over the samples / the global batch."""
    return nn.functional.cross_entropy(model(x), y, reduction="sum") / GLOBAL_BATCH


def _train_ps(make_opt, shares) -> nn.Module:
    """Train ``CLOCKS`` clocks with 3 PS workers; ``shares(clock, w)`` = worker w's sample indices.
    Returns the final global weights (worker 0's model after the final pull)."""
    ps = PSConfig(consistency=BSP(), update=DeltaUpdate(), num_servers=2, chunk_bytes=256)
    cfgs = [shard_config_from(ps, num_workers=NUM_WORKERS, shard_index=i) for i in range(2)]
    x, y = _data()
    models = [_model() for _ in range(NUM_WORKERS)]
    errors: list[BaseException] = []
    with servers(cfgs) as srvs:
        syncs = [
            PSSync(
                m,
                ps,
                [s.address for s in srvs],
                SECRET,
                w,
                num_workers=NUM_WORKERS,
                optimizer=make_opt(m),
                options=FAST,
            )
            for w, m in enumerate(models)
        ]

        # BSP bounds a read from below: a pull for clock c holds every update of clocks < c and
        # may hold some of clock c.  The exact comparison needs every worker to start from the
        # initial weights, so nobody pushes clock 0 before everybody pulled clock 0.
        pulled = threading.Barrier(NUM_WORKERS, timeout=30)

        def run(w: int) -> None:
            try:
                syncs[w].initialize()
                pulled.wait()
                for clock in range(CLOCKS):
                    idx = shares(clock, w)
                    _loss(models[w], x[idx], y[idx]).backward()
                    syncs[w].push_pull(clock)
                syncs[w].pull_final(CLOCKS)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(w,)) for w in range(NUM_WORKERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for s in syncs:
            s.close()
    assert not errors, errors
    return models[0]


def _params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_delta_sgd_under_bsp_is_torch_sgd_on_the_global_batch() -> None:
    cut = (0, 20, 36, GLOBAL_BATCH)  # 20 / 16 / 12 samples: an uneven split

    def sgd(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9, weight_decay=0.01, nesterov=True)

    def share(clock: int, w: int) -> range:
        return range(clock * GLOBAL_BATCH + cut[w], clock * GLOBAL_BATCH + cut[w + 1])

    got = _train_ps(sgd, share)
    ref = _model()
    opt = sgd(ref)
    x, y = _data()
    for clock in range(CLOCKS):
        idx = range(clock * GLOBAL_BATCH, (clock + 1) * GLOBAL_BATCH)
        opt.zero_grad()
        _loss(ref, x[idx], y[idx]).backward()
        opt.step()
    moved = (_params(ref) - _params(_model())).abs().max()
    assert moved > 0.05  # the check below is not vacuous
    assert torch.allclose(_params(got), _params(ref), rtol=1e-5, atol=1e-6), (
        (_params(got) - _params(ref)).abs().max()
    )


def test_delta_adam_clock_is_one_adam_step_not_one_per_worker() -> None:
    share_size = GLOBAL_BATCH // NUM_WORKERS

    def adam(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(m.parameters(), lr=0.01)

    def same(clock: int, w: int) -> range:  # every worker sees the same samples
        return range(clock * share_size, (clock + 1) * share_size)

    got = _train_ps(adam, same)
    ref = _model()
    opt = adam(ref)
    x, y = _data()
    for clock in range(CLOCKS):
        idx = same(clock, 0)
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x[idx]), y[idx]).backward()  # the mean over the share
        opt.step()
    assert torch.allclose(_params(got), _params(ref), rtol=1e-5, atol=1e-6), (
        (_params(got) - _params(ref)).abs().max()
    )
    # The old rule (every worker's step added) would have moved the weights three times as far.
    step = (_params(ref) - _params(_model())).abs().max()
    assert step > 0.01
