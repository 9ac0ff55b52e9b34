"""The loop machine's actions carried out on the loop's parts (``trainer/loop.py`` answers its
queries): records, the engine's step, the role's duties, groups and strategies, the log, hooks."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from flotilla.core.log import get_logger
from flotilla.trainer import loop_events as ev

if TYPE_CHECKING:
    from flotilla.trainer.loop import Loop

__all__ = ["carry_out"]

log = get_logger("loop")
LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def carry_out(loop: Loop, e: ev.Effect) -> None:
    p = loop.p
    match e:
        case ev.Log(level=level, message=message):
            log.log(LEVELS[level], "%s", message)
        case ev.SetStep(step=step):
            p.engine.step = step
        case ev.AfterCommit():
            p.engine.after_commit()
        case ev.RecordUnit(flush=flush, digest=digest):
            assert loop.unit is not None
            res, where, step_s = loop.unit
            dg = p.engine.digest if digest else None
            p.records.unit(res, where, step_s, flush=flush, extra=loop.sync().record_fields(), digest=dg)
        case ev.RecordDiscarded(step=step, epoch=epoch, reason=reason):
            p.records.discarded(step, epoch, reason)
        case ev.LocalCheckpoint(step=step, rank=rank):
            p.duties.local_checkpoint(step, loop.sync(), rank)
        case ev.Checkpoint(step=step, agreed=agreed):
            p.duties.checkpoint(step, loop.sync(), agreed=agreed)
        case ev.Evaluate(step=step):
            p.duties.evaluate(step, loop.sync())
        case ev.FlushRecords():
            p.records.flush()
        case ev.Nonfinite(step=step, what=what, own=own):
            p.duties.nonfinite(step, what, own)
        case ev.CloseGroup():
            p.membership.close_group()
        case ev.CloseStrategy():
            loop.sync().close()
        case ev.DutiesDone(step=step):
            if p.on_phase is not None:
                p.on_phase(step, "boundary")
        case ev.BoundaryDone():
            for hook in list(loop.boundary_hooks):
                hook(loop)
        case _:
            raise TypeError(f"loop: {e!r} is not an action the loop carries out")
