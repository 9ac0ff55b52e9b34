"""What a worker does at step boundaries besides training (``trainer/parts.Duties``): restore a
resumed job's state, write checkpoints (rank 0; the loop's boundary rule says when), evaluate
(rank 0), report the job's result and export the model, and stop on a non-finite value.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from flotilla.core.errors import CallTimeout
from flotilla.core.log import get_logger
from flotilla.report.headline import eval_fields
from flotilla.roles import worker_files
from flotilla.roles.worker_records import Recorder
from flotilla.sync.base import SyncStrategy
from flotilla.trainer.optim import scheduler_state
from flotilla.trainer.replica import ReplicaEngine
from flotilla.trainer.task_load import evaluate_task

if TYPE_CHECKING:
    from flotilla.roles.worker import Worker

__all__ = ["WorkerDuties"]

FINISH_WAIT_S = 120.0  # how long rank 0 keeps sending the job's result to a silent coordinator
DONE_WAIT_S, DONE_TRY_S = 5.0, 1.0  # a finished worker's "done": sent again after 1 s, for up to 5 s

log = get_logger("worker")


class WorkerDuties:
    def __init__(self, worker: Worker, engine: ReplicaEngine, recorder: Recorder) -> None:
        self.w, self.engine, self.recorder = worker, engine, recorder
        self.checkpointer = worker_files.checkpointer(worker.cfg, worker.files)
        # the checkpoint this worker resumed from, for the job's strategy when it is built
        self._resumed: worker_files.Restored | None = None

    def restore(self) -> int | None:
        w = self.w
        self._resumed = worker_files.restore(w.cfg, w.files, w.model, w.opt)
        return self._resumed.step if self._resumed is not None else None

    def resume_strategy(self, strategy: SyncStrategy, rank: int, world_size: int) -> None:
        """Give the job's strategy, once, the state of the checkpoint this worker resumed from:
        the shared state, and the local state its rank saved in a view of the same size."""
        got, self._resumed = self._resumed, None
        if got is None:
            return
        if got.strategy:
            strategy.load_state_dict(got.strategy)
        if got.directory is None or not strategy.local_state_dict():
            return
        local = worker_files.read_local_state(got.directory, got.step, rank, world_size)
        if local is None:
            log.warning(
                "no local state of rank %d of %d at step %d in %s: this worker resumes with the "
                "checkpoint's (rank 0's) -- the run goes on, but not bitwise as uninterrupted",
                rank, world_size, got.step, got.directory,
            )  # fmt: skip
            return
        strategy.load_local_state_dict(local)
        log.info("rank %d took back its local state of step %d (%d tensors)", rank, got.step, len(local))

    def local_checkpoint(self, step: int, strategy: SyncStrategy, rank: int) -> None:
        """Every rank writes its strategy's local state (if it has one) at the checkpoint steps."""
        c = self.checkpointer
        if not c.enabled or c.directory is None:
            return
        local = strategy.local_state_dict()
        if local:
            view = self.w.membership.view
            world = view.world_size if view is not None else 1
            worker_files.write_local_state(c.directory, step, rank, world, local, c.keep)

    def restore_lost(self, strategy: SyncStrategy | None = None) -> int | None:
        w = self.w
        try:  # (this worker's own newest checkpoint, if one is being written)
            self.checkpointer.flush()
        except Exception as exc:  # (the previous complete checkpoint serves)
            log.error("the checkpoint being written failed (%s): restoring from the newest complete one", exc)
        got = worker_files.restore_lost(w.cfg, w.files, w.model, w.opt)
        if got is None:
            return None
        if strategy is not None:
            strategy.load_state_dict(got.strategy)
        return got.step

    def checkpoint(self, step: int, strategy: SyncStrategy, *, agreed: bool) -> None:
        """Rank 0 writes the committed state -- the same on every replica under a strategy that
        votes on every unit (``agreed``), else the job's state where the strategy can make the
        model hold it (``SyncStrategy.checkpoint_state``: AD-PSGD's average; ps: the servers
        hold the state)."""
        if self.checkpointer.enabled and (agreed or strategy.checkpoint_state()):
            opt = self.w.opt
            self.checkpointer.write(
                step,
                self.w.model,
                opt.optimizer,
                scheduler=scheduler_state(opt.scheduler),
                strategy=strategy.state_dict(),
            )

    def evaluate(self, step: int, strategy: SyncStrategy) -> None:
        strategy.before_eval()
        self._evaluate_and_record(step)

    def _evaluate_and_record(self, step: int) -> dict[str, float]:
        ev = evaluate_task(self.w.task, self.w.model, self.w.eval_data)
        self.recorder.evaluation(step, ev)
        return ev

    def finish(self, step: int, strategy: SyncStrategy, rank: int, *, agreed: bool) -> int:
        """This worker trained its last step: rank 0 evaluates, exports and reports the job's
        result; any other rank tells the coordinator it is done (not a leave mid-job) -- and
        reports the result instead if its strategy says so (``take_over``)."""
        w = self.w
        self.checkpointer.flush()  # (the job is done only with its checkpoints on disk)
        if rank != 0:
            self._say_done()
            over = lambda: w.link.stop_requested or w.link.coordinator_gone
            chosen = lambda: w.link.reporter == w.worker_id  # (rendezvous.reporter)
            if not strategy.take_over(over, chosen, lambda: w.link.standby == w.worker_id):
                return 0
            log.warning("worker %d reports the job's result: the worker that was to is gone", w.worker_id)
        elif not strategy.finalize(lambda: w.link.stop_requested):
            return 0
        w.faults.reporting(step)  # (tests: core/faults.py)
        ev = self._evaluate_and_record(step)
        w.link.flush()
        result: dict[str, Any] = {**eval_fields(w.task, ev), "steps": step}
        if agreed:
            result["digest"] = self.engine.digest()
        model_file = worker_files.export(w.files, w.model)
        if model_file is not None:
            result["model_file"] = str(model_file)
        if w.link.coordinator_gone:  # nobody to tell: the result goes beside the records
            path = worker_files.write_result(w.files, result)
            log.info("the coordinator is gone: result %s written to %s", result, path)
            return 0
        self._report_finish(result)
        return 0

    def _report_finish(self, result: dict[str, Any]) -> None:
        """``finish``, sent again while unanswered (a lost request or reply: the coordinator
        applies it once more, which changes nothing) for up to ``FINISH_WAIT_S``; a coordinator
        found gone meanwhile gets the result beside the records instead."""
        w = self.w
        deadline = time.monotonic() + FINISH_WAIT_S
        while True:
            try:
                w.link.call("finish", {"worker_id": w.worker_id, "result": result})
                return
            except CallTimeout as exc:
                if w.link.coordinator_gone:
                    path = worker_files.write_result(w.files, result)
                    log.info("the coordinator is gone: result %s written to %s", result, path)
                    return
                if time.monotonic() >= deadline:
                    raise
                log.warning("the job's result was not acknowledged (%s): sending it again", exc)

    def _say_done(self) -> None:
        """A ``leave`` marked ``finished`` (its state becomes DONE, and the summary does not list
        it among the workers that left mid-job), sent again when unanswered for ``DONE_TRY_S``
        (a second one changes nothing: ``cluster/rendezvous.py``) for up to ``DONE_WAIT_S`` -- a
        lost one would leave the coordinator to find this worker silent and count it as lost;
        best effort: the job's end is not held up."""
        w = self.w
        if w.link.coordinator_gone:
            return
        try:
            w.link.flush()
            deadline = time.monotonic() + DONE_WAIT_S
            while True:
                try_s = max(0.05, min(DONE_TRY_S, deadline - time.monotonic()))
                try:
                    body = {"worker_id": w.worker_id, "finished": True}
                    reply = w.link.call("leave", body, timeout_s=try_s)
                    w.link.note_standby(reply.get("standby"))
                    return
                except CallTimeout:
                    if time.monotonic() >= deadline or w.link.coordinator_gone:
                        raise
        except Exception as exc:  # (the coordinator may have ended the job already)
            log.debug("done not reported to the coordinator: %s", exc)

    def task_error(self, step: int, exc: Exception) -> None:
        """Training raised ``exc`` at ``step`` (the task's code: a corrupt record, a bug -- not a
        lost machine): under ``job.on_error: stop`` the job stops with one line naming it, told to
        the coordinator before this process ends (another worker given the same batch would raise
        it too: the job would lose its workers one by one); ``lose_worker``: only this worker is
        lost, as a dead machine is."""
        w = self.w
        first = str(exc).splitlines()[0] if str(exc) else ""
        line = (
            f"worker {w.opts.name or w.worker_id} raised {type(exc).__name__}: {first} at step {step} "
            f"(the traceback is in its log)"
        )
        if w.cfg.job.on_error != "stop" or w.link.coordinator_gone:
            log.error("%s; this worker is lost (job.on_error: %s)", line, w.cfg.job.on_error)
            return
        line += ": the job stops (job.on_error: stop; lose_worker trains on without this worker)"
        log.error("%s", line)
        body = {"worker_id": w.worker_id, "reason": line, "step": step, "own": True, "model_file": None}
        try:
            w.link.call("fail_job", body, timeout_s=5.0)
        except Exception as err:  # (the coordinator may be gone: the launcher names the exit)
            log.warning("the job's error was not told to the coordinator: %s", err)

    def nonfinite(self, step: int, what: str, own: bool) -> None:
        """One line, also sent to the coordinator (the job's error); rank 0 exports the last
        finite weights (nothing of the failed unit was applied)."""
        w = self.w
        mode = w.cfg.job.nonfinite
        line = (
            f"non-finite {what} at step {step} on worker {w.opts.name or w.worker_id}: the job stops "
            f"(job.nonfinite: {mode}); the model keeps the last finite weights"
        )
        log.error("%s", line)
        view = w.membership.view
        model_file = None
        if view is not None and view.rank_of(w.worker_id) == 0:
            model_file = worker_files.export(w.files, w.model)
        if own or model_file is not None:
            body = {"worker_id": w.worker_id, "reason": line, "step": step, "own": own,
                    "model_file": str(model_file) if model_file is not None else None}  # fmt: skip
            w.link.call("fail_job", body)
