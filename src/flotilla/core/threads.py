"""Intra-op thread policy of flotilla's own processes (workers, pipeline stages, PS servers).

Several of them share a machine's cores, so together they must not ask for more intra-op
threads than there are cores: with torch's default (one thread per core in *every* process) idle
OpenMP threads spin between small ops.  Measured on the 2-core development machine: small models
trained ~20x slower with oversubscribed workers, and shard 0 of ``examples/ps_ssp.yaml`` used
62 % of a core instead of 16 % (the job's clock: 32 ms instead of 22-24 ms).

So each process runs ``max(1, usable_cores // local_procs)`` threads, where ``usable_cores`` is
``len(os.sched_getaffinity(0))`` (the cores this process may run on, e.g. under ``taskset``) and
``local_procs`` is ``$FLOTILLA_LOCAL_PROCS``: the number of compute processes (workers, stages,
servers) the launcher (``flotilla run``) starts on this machine, set by it in every child's
environment.  A process started by hand (``flotilla worker``) does not know what else runs on its
machine and keeps **one** thread.  ``FLOTILLA_TORCH_THREADS`` overrides both.  torch is imported
only when :func:`use_torch_threads` is called, so the torch-free layers may import ``flotilla.core``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from flotilla.core.errors import ConfigError

__all__ = ["ENV_VAR", "LOCAL_PROCS_VAR", "thread_count", "usable_cores", "use_torch_threads"]

ENV_VAR = "FLOTILLA_TORCH_THREADS"
LOCAL_PROCS_VAR = "FLOTILLA_LOCAL_PROCS"


def _positive(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {raw!r}")
    return n


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_count(env: Mapping[str, str], cores: int) -> int:
    """The intra-op threads for a process with environment ``env`` on ``cores`` usable cores:
    ``$FLOTILLA_TORCH_THREADS`` if set, else ``max(1, cores // $FLOTILLA_LOCAL_PROCS)`` if the
    launcher set that, else 1 (see the module docstring)."""
    explicit = _positive(env, ENV_VAR)
    if explicit is not None:
        return explicit
    local_procs = _positive(env, LOCAL_PROCS_VAR)
    if local_procs is None:
        return 1
    return max(1, cores // local_procs)


def use_torch_threads() -> int:
    """Set torch's intra-op threads to :func:`thread_count` of this process; returns it."""
    n = thread_count(os.environ, usable_cores())
    import torch

    torch.set_num_threads(n)
    return n
