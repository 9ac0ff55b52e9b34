"""When a view forms, the members of a per-view group agree on the most advanced state and, if
anyone needs it, its holder broadcasts it (model, optimizer state, step).

The decision is pure (``sync/plan.choose_donor``: the MAX step among the members holding a state,
ties to the MIN rank); this module gathers its inputs with one small all-reduce and moves the
state with ``comm.collective.broadcast_state`` (msgpack metadata + tensors, never pickle).
"""

from __future__ import annotations

import torch

from flotilla.comm.collective import Group, broadcast_state
from flotilla.sync.plan import NO_STATE, StateProbe, choose_donor, donor_rank
from flotilla.trainer.parts import Engine

__all__ = ["agree_state"]


def agree_state(group: Group, engine: Engine, *, epoch: int, wanted: bool) -> bool:
    """Agree on the state to train from; True if a state was transferred.  Raises
    ``CollectiveError`` if the group fails (the caller recovers)."""
    mine = engine.step if engine.has_state else NO_STATE
    probe = torch.tensor([float(wanted), float(mine), -float(mine)], dtype=torch.float64)
    group.allreduce(probe, op="max")
    wanted_v, max_v, neg_min_v = probe.tolist()
    choice = choose_donor(
        StateProbe(wanted=wanted_v > 0, max_step=int(max_v), min_step=int(-neg_min_v)), epoch=epoch
    )
    if not choice.transfer:
        return False
    holder = torch.tensor([float(donor_rank(group.rank, mine, choice.step, group.world_size))])
    group.allreduce(holder, op="min")
    src = int(holder.item())
    if group.rank == src:
        meta, tensors = engine.export_state()
        broadcast_state(group, src, meta, tensors)
    else:
        meta, tensors = broadcast_state(group, src, None, None)
        engine.import_state(meta, tensors)
        engine.has_state = True
    return True
