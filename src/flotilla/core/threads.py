"""Intra-op thread policy of flotilla's own processes (workers, pipeline stages, PS servers).

Several of them share a machine's cores, so each runs **one** torch intra-op thread unless
``FLOTILLA_TORCH_THREADS`` says otherwise: with torch's default (one per core) idle OpenMP
threads spin between small ops.  Measured on the 2-core development machine: small models
trained ~20x slower with oversubscribed workers, and shard 0 of ``examples/ps_ssp.yaml`` used
62 % of a core instead of 16 % (the job's clock: 32 ms instead of 22-24 ms).  torch is imported
only when this is called, so the torch-free layers may import ``flotilla.core``.
"""

from __future__ import annotations

import os

from flotilla.core.errors import ConfigError

__all__ = ["ENV_VAR", "use_torch_threads"]

ENV_VAR = "FLOTILLA_TORCH_THREADS"


def use_torch_threads() -> int:
    """Set torch's intra-op threads to ``$FLOTILLA_TORCH_THREADS`` (default 1); returns it."""
    raw = os.environ.get(ENV_VAR, "1")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"{ENV_VAR} must be an integer >= 1, got {raw!r}")
    import torch

    torch.set_num_threads(n)
    return n
