"""``sync/state.py``'s device-side non-finite flag (issue 34): what a fused optimizer's step reads
instead of the host; exactly 0.0 or 1.0 (the fused step subtracts it from its step counts)."""

from __future__ import annotations

import math

import torch

from flotilla.sync.state import nonfinite_flag


def test_the_flag_is_one_for_a_non_finite_gradient_or_loss_and_zero_otherwise() -> None:
    grads = [torch.ones(3), torch.zeros(2, 2)]
    finite = torch.tensor(1.5, dtype=torch.float64)
    for g_bad, loss, want in [
        (None, finite, 0.0),
        (None, torch.tensor(math.nan, dtype=torch.float64), 1.0),
        (math.inf, finite, 1.0),
        (math.nan, torch.tensor(math.inf, dtype=torch.float64), 1.0),  # both: still exactly 1
        (None, None, 0.0),
    ]:
        gs = [g.clone() for g in grads]
        if g_bad is not None:
            gs[1][0, 1] = g_bad
        flag = nonfinite_flag(gs, loss)
        assert flag is not None and flag.dim() == 0 and float(flag) == want, (g_bad, loss)
        if g_bad is None:
            assert all(torch.equal(a, b) for a, b in zip(gs, grads))  # (multiplied by 1.0: unchanged)
