"""When a view forms, the members of a per-view group agree on the most advanced state and, if
anyone needs it, its holder broadcasts it (model, optimizer state, step, and the strategy's own
state: ``SyncStrategy.state_dict``).

The decision is pure (``sync/plan.choose_donor``: the MAX step among the members holding a state,
ties to the MIN rank); this module gathers its inputs with one small all-reduce and moves the
state with ``comm.state_transfer.broadcast_state`` (msgpack metadata + tensors, never pickle).
"""

from __future__ import annotations

from typing import Any

import torch

from flotilla.comm.collective import Group
from flotilla.comm.state_transfer import broadcast_state
from flotilla.core.log import get_logger
from flotilla.sync.base import SyncStrategy
from flotilla.sync.plan import NO_STATE, StateLost, StateProbe, choose_donor, donor_rank
from flotilla.trainer.parts import Duties, Engine

__all__ = ["agree_or_restore", "agree_state"]

log = get_logger("loop")


def agree_or_restore(
    group: Group,
    engine: Engine,
    duties: Duties,
    *,
    epoch: int,
    wanted: bool,
    strategy: SyncStrategy,
    average: bool = False,
) -> None:
    """:func:`agree_state`; if every replica of the state is gone, every member falls back to the
    job's newest checkpoint (the steps after it are redone), or ``StateLost`` stops the job."""
    try:
        agree_state(group, engine, epoch=epoch, wanted=wanted, strategy=strategy, average=average)
    except StateLost as exc:
        step = duties.restore_lost(strategy)
        if step is None:
            raise
        log.warning("%s: resuming from the job's newest checkpoint, at step %d", exc, step)
        engine.step, engine.has_state = step, True
        agree_state(group, engine, epoch=epoch, wanted=wanted, strategy=strategy)


def agree_state(
    group: Group,
    engine: Engine,
    *,
    epoch: int,
    wanted: bool,
    strategy: SyncStrategy | None = None,
    average: bool = False,
) -> bool:
    """Agree on the state to train from; True if a state was transferred.  ``average``: this
    member switches into the view's strategy from one whose replicas drift apart; if EVERY member
    does, their weights first become their exact mean (``Engine.average``), so a switch keeps what
    each replica learnt.  (One probe carries it: the members' collectives match either way.)
    Raises ``CollectiveError`` if the group fails (the caller recovers)."""
    mine = engine.step if engine.has_state else NO_STATE
    probe = torch.tensor([float(wanted), float(mine), -float(mine), -float(average)], dtype=torch.float64)
    group.allreduce(probe, op="max")
    wanted_v, max_v, neg_min_v, neg_all_average = probe.tolist()
    if neg_all_average < 0:  # (the MAX of -flag is -1 only when every member's flag is 1)
        engine.average(group)
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
        own = strategy.state_dict() if strategy is not None else {}
        broadcast_state(group, src, {**meta, "strategy_keys": list(own)}, [*tensors, *own.values()])
    else:
        meta, tensors = broadcast_state(group, src, None, None)
        tensors, own = split_strategy_state(meta, tensors)
        engine.import_state(meta, tensors)
        if strategy is not None:
            strategy.load_state_dict(own)
        engine.has_state = True
    return True


def split_strategy_state(meta: dict[str, Any], tensors: list[Any]) -> tuple[list[Any], dict[str, Any]]:
    """The engine's tensors and the strategy's named state, from a transfer's ``meta``."""
    keys = list(meta.pop("strategy_keys", []) or [])
    if not keys:
        return tensors, {}
    return tensors[: -len(keys)], dict(zip(keys, tensors[-len(keys) :]))
