"""Which GPU each CUDA worker of a host computes on, and which transport the job's groups use
(pure; issue 34).

Workers with ``device: cuda`` on one host take that host's visible GPUs in configuration order:
worker k of the host gets local index ``k mod gpus`` (indices count the GPUs
``CUDA_VISIBLE_DEVICES`` leaves visible, as ``torch.device("cuda", i)`` does).  Which workers
share a host: ``flotilla run`` starts every worker on its own machine (``one_host``: the
``node`` labels, which also shape the link model, are ignored); roles started by hand (several
hosts, docs/multihost.md) are placed per ``node``, which then names their host.  Where a host has
more CUDA workers than GPUs they share them, which NCCL refuses (two ranks of one communicator on
one GPU).

The transport (``backend``): ``nccl`` only when every worker of the job is a CUDA worker with a
GPU of its own and none can join later (a revocation schedule that adds workers: a joiner's GPU
is not known in advance); else ``gloo``, which reduces CUDA tensors too (a CPU worker in the
group, shared GPUs, joiners).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ONE_HOST_VAR", "GpuPlacement", "place_gpus"]

ONE_HOST_VAR = "FLOTILLA_ONE_HOST"  # set to "1" by ``flotilla run`` for the roles it starts


@dataclass(frozen=True, slots=True)
class GpuPlacement:
    index: dict[str, int]  # CUDA worker -> local GPU index on its host
    shared: dict[str, tuple[str, ...]]  # host -> its CUDA workers, where they outnumber its GPUs
    gpus: int  # GPUs visible on each host
    all_cuda: bool = True  # every worker computes on CUDA
    joiners: bool = False  # workers may join that the configuration does not list

    @property
    def backend(self) -> str:
        """``nccl`` when every worker is a CUDA worker owning its GPU and none joins later, else
        ``gloo`` (module doc)."""
        ok = self.index and self.all_cuda and not self.shared and not self.joiners
        return "nccl" if ok else "gloo"

    def sharing_warning(self) -> str:
        """One line naming the workers that share GPUs ("" when none do)."""
        if not self.shared:
            return ""
        parts = [f"node {n!r}: {len(ws)} workers {list(ws)}" for n, ws in sorted(self.shared.items())]
        return (
            f"more CUDA workers than GPUs ({self.gpus} per host): {'; '.join(parts)} share them "
            "(collectives go through gloo, not NCCL; steps are slower than with a GPU each)"
        )


def place_gpus(
    workers: Sequence[tuple[str, str, str]], gpus: int, *, one_host: bool = False, joiners: bool = False
) -> GpuPlacement:
    """``workers``: ``(name, node, device)`` in configuration order; ``gpus``: visible per host
    (> 0); ``one_host``: they all run on one machine; ``joiners``: others may join later."""
    if gpus < 1:
        raise ValueError(f"place_gpus needs at least one GPU, got {gpus}")
    by_host: dict[str, list[str]] = {}
    for name, node, device in workers:
        if device == "cuda":
            by_host.setdefault("local" if one_host else node, []).append(name)
    index = {name: k % gpus for names in by_host.values() for k, name in enumerate(names)}
    shared = {host: tuple(names) for host, names in by_host.items() if len(names) > gpus}
    all_cuda = all(device == "cuda" for _, _, device in workers)
    return GpuPlacement(index=index, shared=shared, gpus=gpus, all_cuda=all_cuda, joiners=joiners)
