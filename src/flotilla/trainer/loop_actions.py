"""The loop machine's effects carried out on the loop's parts: its actions (records, the engine's
step, the role's duties, groups and strategies, the log, hooks), and the two queries that take
more than one call to answer (a view's entry, the poll before a unit); ``trainer/loop.py``
answers the others."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from flotilla.core.errors import CollectiveError
from flotilla.core.log import get_logger
from flotilla.sync.plan import StateLost
from flotilla.trainer import loop_events as ev
from flotilla.trainer.boundary import SwitchAt
from flotilla.trainer.state_sync import agree_or_restore

if TYPE_CHECKING:
    from flotilla.trainer.loop import Loop

__all__ = ["answer_poll", "carry_out", "enter_view"]

log = get_logger("loop")
LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def carry_out(loop: Loop, e: ev.Effect) -> None:
    p = loop.p
    match e:  # (the actions of every unit first: a match tries its cases in order)
        case ev.RecordUnit(flush=flush, digest=digest, strategy=strategy):
            assert loop.unit is not None
            res, where, step_s = loop.unit
            dg = p.engine.digest if digest else None
            extra = (
                {**loop.sync().record_fields(), "strategy": strategy}
                if strategy
                else loop.sync().record_fields()
            )
            if res.loss_scale is not None:  # (fp16: the scale the unit ran with, and its overflow)
                extra = {**extra, "loss_scale": res.loss_scale, "overflow": res.overflow}
            p.records.unit(res, where, step_s, flush=flush, extra=extra, digest=dg)
        case ev.SetStep(step=step):
            p.engine.step = step
        case ev.AfterCommit():
            p.engine.after_commit()
            loop.commits += 1
        case ev.BoundaryDone():
            for hook in list(loop.boundary_hooks):
                hook(loop)
        case ev.Log(level=level, message=message):
            log.log(LEVELS[level], "%s", message)
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
        case _:
            raise TypeError(f"loop: {e!r} is not an action the loop carries out")


def enter_view(loop: Loop, e: ev.EnterView) -> ev.Event:
    """Bind the view's group, agree on the state (averaging the replicas first when every member
    asks: ``average``), start."""
    assert loop.view is not None
    p, sync = loop.p, loop.sync()
    try:
        if e.bind:
            group = p.membership.group(loop.view)
            sync.bind(group)
            agree_or_restore(
                group, p.engine, p.duties, epoch=e.epoch, wanted=e.wanted, strategy=sync, average=e.average
            )
        if e.start:
            _start(loop, sync)
        return ev.Entered(p.engine.step, p.engine.has_state, sync.joined_at() if e.start else 0)
    except CollectiveError as exc:
        return ev.EnterFailed(str(exc))


def _start(loop: Loop, sync: Any) -> None:
    """Start the strategy; a newcomer for whom no live member holds the state (``StateLost``:
    every worker that had it is gone) resumes from the job's newest checkpoint, if it has one."""
    p = loop.p
    try:
        sync.start()
    except StateLost as exc:
        step = p.duties.restore_lost(sync)
        if step is None:
            raise
        log.warning("%s: resuming from the job's newest checkpoint, at step %d", exc, step)
        p.engine.step, p.engine.has_state = step, True


def answer_poll(loop: Loop, e: ev.Poll) -> ev.Polled:
    p, m = loop.p, loop.p.membership
    switch = p.switch_requests.pop(0) if e.propose and p.switch_requests else 0
    pending = m.pending_epoch() if e.propose else 0
    done = e.ask_done and loop.sync().training_done()
    announced = tuple(sw for sw in m.announced() if _known(loop, sw))
    return ev.Polled(m.orphaned, m.stop_requested, m.leave_requested, pending, switch, done, announced)


def _known(loop: Loop, sw: SwitchAt) -> bool:
    if loop.p.strategies.known(sw.option):
        return True
    if sw not in loop.ignored:
        loop.ignored.add(sw)
        log.error("a switch to option %d at step %d was announced; this worker has no such option: ignored",
                  sw.option, sw.step)  # fmt: skip
    return False
