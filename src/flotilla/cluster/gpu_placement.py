"""Which GPU each CUDA worker of a host computes on (pure; issue 34).

Workers with ``device: cuda`` on one node (``cluster.workers[i].node``) take that host's visible
GPUs in configuration order: worker k of the node gets local index ``k mod gpus`` (indices count
the GPUs ``CUDA_VISIBLE_DEVICES`` leaves visible, as ``torch.device("cuda", i)`` does).  Where a
node has more CUDA workers than GPUs they share, which NCCL refuses (two ranks of one
communicator on one GPU): their groups use gloo, which reduces CUDA tensors (``backend``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["GpuPlacement", "place_gpus"]


@dataclass(frozen=True, slots=True)
class GpuPlacement:
    index: dict[str, int]  # CUDA worker -> local GPU index on its node
    shared: dict[str, tuple[str, ...]]  # node -> its CUDA workers, where they outnumber its GPUs
    gpus: int  # GPUs visible on each host

    @property
    def backend(self) -> str:
        """``nccl`` when every CUDA worker owns its GPU, else ``gloo``."""
        return "gloo" if self.shared or not self.index else "nccl"

    def sharing_warning(self) -> str:
        """One line naming the workers that share GPUs ("" when none do)."""
        if not self.shared:
            return ""
        parts = [f"node {n!r}: {len(ws)} workers {list(ws)}" for n, ws in sorted(self.shared.items())]
        return (
            f"more CUDA workers than GPUs ({self.gpus} per host): {'; '.join(parts)} share them "
            "(collectives go through gloo, not NCCL; steps are slower than with a GPU each)"
        )


def place_gpus(workers: Sequence[tuple[str, str, str]], gpus: int) -> GpuPlacement:
    """``workers``: ``(name, node, device)`` in configuration order; ``gpus``: visible per host (> 0)."""
    if gpus < 1:
        raise ValueError(f"place_gpus needs at least one GPU, got {gpus}")
    by_node: dict[str, list[str]] = {}
    for name, node, device in workers:
        if device == "cuda":
            by_node.setdefault(node, []).append(name)
    index = {name: k % gpus for names in by_node.values() for k, name in enumerate(names)}
    shared = {node: tuple(names) for node, names in by_node.items() if len(names) > gpus}
    return GpuPlacement(index=index, shared=shared, gpus=gpus)
