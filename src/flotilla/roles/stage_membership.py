"""A pipeline stage's membership in the one loop (``roles/stage.py`` assembles it): the fixed stage
group (``StaticMembership``: view 1 of the job's stages, namespace ``epoch/1/``). A broken group
(a stage died, or the network reset a connection with every stage alive) re-forms where the
stage was given a ``regroup`` (one instance of a flushing schedule:
``roles/stage_replicas.Regroup``): every stage whose collective failed moves to the next epoch's
namespace and meets the others there; they go on from the step they all stand at, which the
failed step never passed. A stage that died never arrives (its launcher stops the others first:
a restart from the checkpoint); stages at different steps (the network cut the step's vote
itself, so some applied it) end the run as before. Without ``regroup`` a broken group ends the
run.
"""

from __future__ import annotations

from collections.abc import Callable

from flotilla.cluster.membership import View
from flotilla.comm.collective import Group
from flotilla.core.errors import CollectiveError, FlotillaError
from flotilla.core.log import get_logger
from flotilla.trainer.parts import StaticMembership

__all__ = ["LOST_STAGE", "MAX_REGROUPS", "StageGroupBroke", "StageMembership"]

log = get_logger("pipeline-stage")


LOST_STAGE = "the pipeline stage group broke (another stage failed): this stage stops with its pipeline"
MAX_REGROUPS = 10  # re-formings of one instance's stage group that break in a row before it gives up


class StageGroupBroke(FlotillaError):
    """This stage failed because the stage group broke: another stage's failure, not its own."""


class StageMembership(StaticMembership):
    """The job's stages, fixed; a broken group re-forms in the next epoch when ``regroup`` is set,
    else ends the run (module doc).  ``make_group(view, tag)`` builds the group of ``view`` under
    the namespace suffix ``tag``."""

    # ((the new epoch, its group) -> the stage goes on on it)
    regroup: Callable[[int, Group], None] | None = None
    # (its group namespace's suffix past the epoch: a generation's serial, a newcomer's arrival;
    # never reused, so a group never meets where a process given up left rendezvous keys)
    tag = ""

    def group(self, view: View) -> Group:
        if self._group is None:
            self._group = self._make_group(view, self.tag)
        return self._group

    def recover(self, failed: frozenset[int]) -> View | None:
        if self.regroup is None:
            raise StageGroupBroke(LOST_STAGE)
        for _ in range(MAX_REGROUPS):  # (a re-forming the network breaks too: the next epoch)
            self.close_group()
            self.view = View(epoch=self.view.epoch + 1, members=self.view.members)
            try:
                group = self.group(self.view)
            except CollectiveError as exc:  # (a stage never came: it is gone)
                raise StageGroupBroke(f"{LOST_STAGE} (epoch {self.view.epoch} did not form: {exc})") from None
            try:
                self.regroup(self.view.epoch, group)
                return self.view
            except CollectiveError as exc:
                log.warning(
                    "stage %d: re-forming in epoch %d broke: %s", self.worker_id, self.view.epoch, exc
                )
        self.close_group()
        raise StageGroupBroke(
            f"the pipeline stage group broke and did not re-form in {MAX_REGROUPS} epochs in a row "
            f"(another stage failed: this stage stops with its pipeline)"
        )
