"""A stage's side of losing a pipeline instance (``strategy.replicas`` > 1; the rule is
``pipeline/replicas.py``'s, the launcher's side ``launch/pipeline_instances.py``).

When a unit breaks (its stage group or its replica group failed), the loop asks the membership
to recover.  :class:`ReplicaMembership` waits for the launcher's next generation of instances in
the rendezvous store (up to the step timeout; none: the stage fails as before, and the launcher
decides).  A stage whose instance is not in it is out of the job.  A survivor re-forms
(:class:`Reform`):

1. a new stage group for its instance (namespace ``pp/<instance>/epoch/<generation>.<serial>/``:
   the old group, with its posted receives, is closed) and, with more than one survivor, a new
   replica group of its stage position (``dp/<stage>/g<generation>.<serial>/``, ranks in instance
   order; ``pipeline/replicas.Generation.serial``);
2. the survivors agree on the state (``trainer/state_sync.agree_state``: if one instance
   applied a step the others did not, the most advanced one sends its weights, optimizer and
   scheduler state to the others), the last stage's loss history too; every stage of the
   instance then checks that it is at the same step as its neighbours (one all-reduce; a
   mismatch fails the stage);
3. the engine goes on from that step (``StageEngine.rebase``) with the instance's new share of
   every batch (its rank among the survivors) -- a step whose update nobody applied is redone
   with the same samples, so nothing is lost -- and the lowest surviving instance leads
   (checkpoints, evaluations, weights).

An instance coming back (``pipeline/replicas.py``): its new stage processes (``joining``: the
planned generation) build their parts, say they are ready, and wait in the new generation's
groups; the running stages poll for a newer generation before each update
(:meth:`ReplicaMembership.newer_generation`, at most every ``POLL_S``), agree on it with the update's
verdict, and move to it after that same step (:meth:`ReplicaMembership.move_to`: the same
re-forming, the newcomers receiving the state).  A move that cannot form (a newcomer died) waits
for the next generation instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flotilla.cluster.membership import View
from flotilla.comm.collective import Group
from flotilla.comm.state_transfer import broadcast_state
from flotilla.core.errors import CollectiveError, FlotillaError
from flotilla.core.log import get_logger
from flotilla.pipeline.replicas import (
    Generation,
    StagePlace,
    broken_key,
    generation_key,
    joined_key,
    lead_of,
    plan_key,
    ready_key,
)
from flotilla.pipeline.schedule import Schedule
from flotilla.roles.stage_membership import StageGroupBroke, StageMembership
from flotilla.roles.stage_parts import StageDuties, StageRecords
from flotilla.trainer.parts import Entry
from flotilla.trainer.pipeline_setup import BatchData
from flotilla.trainer.stage_engine import StageEngine
from flotilla.trainer.state_sync import agree_state

__all__ = ["Reform", "Regroup", "ReplicaMembership", "same_step"]

log = get_logger("pipeline-stage")

POLL_S = 0.2  # the running stages look for a newer generation at most this often
MAX_REFORMS = 10  # re-formings that break in a row before a stage gives up


class ReplicaMembership(StageMembership):
    """A stage of one of several pipeline instances (module doc).  ``reform(generation, group)``
    re-forms this stage in a new generation (:class:`Reform`)."""

    def __init__(
        self,
        place: StagePlace,
        num_stages: int,
        make_group: Callable[[View, str], Group],
        *,
        store: Any,
        replicas: int,
        timeout_s: float,
        joining: int = 0,
    ) -> None:
        super().__init__(place.stage, num_stages, make_group)
        self.place, self.store, self.timeout_s = place, store, timeout_s
        self.generation = Generation(1, tuple(range(replicas)))
        self.joining = joining  # (a newcomer: the generation it joins)
        self.reform: Callable[[Generation, Group], None] | None = None
        self.move_agreed: Callable[[], bool] = lambda: False  # (the engine's verdict: set by the role)
        self._polled, self._seen = 0.0, False

    def read_plan(self) -> None:
        """A newcomer: the generation it joins (its view, and so its first groups', epoch)."""
        try:
            gen = Generation.from_bytes(self.store.get(plan_key(self.joining)))
        except CollectiveError as exc:
            raise StageGroupBroke(f"no plan for generation {self.joining} of instances ({exc})") from None
        self.generation, self.tag = gen, gen.tag
        self.view = View(epoch=gen.number, members=self.view.members)

    def first_view(self) -> Entry | None:
        if not self.joining:
            return super().first_view()
        gen = self.generation
        self.store.set(ready_key(gen.number, self.place.index), b"1")
        log.info("stage process %d: ready to join generation %d", self.place.index, gen.number)
        if self.reform is not None:
            self.reform(gen, self.group(self.view))  # (waits for the running instances to move)
        self.store.set(joined_key(gen.number, self.place.index), b"1")
        return Entry(self.view, initial=False)

    def newer_generation(self) -> bool:
        """Whether a newer generation was announced (the store is asked at most every POLL_S)."""
        now = time.monotonic()
        if not self._seen and now - self._polled >= POLL_S:
            self._polled = now
            self._seen = bool(self.store.check([generation_key(self.generation.number + 1)]))
        return self._seen

    def superseded(self) -> bool:
        """Whether a generation after this stage's was announced (asked of the store each time:
        a group being formed for this one then never forms -- a member died meanwhile)."""
        return bool(self.store.check([generation_key(self.generation.number + 1)]))

    def pending_epoch(self) -> int:
        return self.generation.number + 1 if self.move_agreed() else 0

    def move_to(self, epoch: int) -> View | None:
        """Every stage of every instance agreed to move to generation ``epoch`` after this step."""
        try:
            gen = Generation.from_bytes(self.store.get(generation_key(epoch)))
            if self.place.replica not in gen.instances:
                return None
            self._enter(gen)
        except (CollectiveError, FlotillaError) as exc:
            log.warning("moving to generation %d failed (%s): waiting for the next one", epoch, exc)
            return self.recover(frozenset())
        return self.view

    def _enter(self, gen: Generation) -> None:
        self.close_group()
        self.generation, self._seen, self.tag = gen, False, gen.tag
        self.view = View(epoch=gen.number, members=self.view.members)
        if self.reform is not None:
            self.reform(gen, self.group(self.view))

    def recover(self, failed: frozenset[int]) -> View | None:
        """The next generation's view (None: this instance is out of it); a re-forming that
        breaks too (the network again) waits for the one after, up to ``MAX_REFORMS`` in a row."""
        for attempt in range(1, MAX_REFORMS + 1):
            if not self.store.check([generation_key(self.generation.number + 1)]):
                # (no loss announced yet: say the group broke -- with nobody dead, the launcher
                # announces the same instances again: pipeline/replicas.py)
                self.store.set(broken_key(self.generation.number), b"1")
            gen = self._next_generation()
            if self.place.replica not in gen.instances:
                log.warning("stage process %d: its pipeline instance is out of the job", self.place.index)
                return None
            try:
                self._enter(gen)
                return self.view
            except CollectiveError as exc:
                self.close_group()
                log.warning(
                    "stage process %d: re-forming in generation %d broke (%s; %d of %d in a row)",
                    self.place.index,
                    gen.number,
                    exc,
                    attempt,
                    MAX_REFORMS,
                )
        raise StageGroupBroke(f"the pipeline groups did not re-form in {MAX_REFORMS} generations in a row")

    def _next_generation(self) -> Generation:
        """The newest generation after this stage's, waiting up to the step timeout for one."""
        number = self.generation.number + 1
        try:
            raw = self.store.get(generation_key(number))  # (waits: the store's timeout)
            while self.store.check([generation_key(number + 1)]):
                number += 1
                raw = self.store.get(generation_key(number))
        except CollectiveError as exc:
            raise StageGroupBroke(
                f"a pipeline group broke and no new generation of instances was announced ({exc})"
            ) from None
        return Generation.from_bytes(raw)


@dataclass
class Reform:
    """Re-forms one stage in a new generation of instances (module doc, steps 1-3)."""

    place: StagePlace
    engine: StageEngine
    records: StageRecords
    duties: StageDuties
    make_replica_group: Callable[[Generation, int], Group]  # (generation, rank) -> dp group
    make_data: Callable[[int, int, int], BatchData]  # (first_step, rank, world) -> the share
    make_schedule: Callable[[int], Schedule]  # first step -> the schedule of the remaining steps

    def __call__(self, gen: Generation, group: Group) -> None:
        engine, world = self.engine, len(gen.instances)
        rank = gen.instances.index(self.place.replica)
        if engine.replica_group is not None:
            engine.replica_group.close()
            engine.replica_group = None
        dp = self.make_replica_group(gen, rank) if world > 1 else None
        try:
            if dp is not None:
                agree_state(dp, engine, epoch=gen.number, wanted=False)
                if self.place.stage == engine.num_stages - 1:
                    self._share_losses(dp)
            same_step(group, engine.step, f"pipeline instance {self.place.replica}'s")
        except BaseException:
            if dp is not None:
                dp.close()
            raise
        step = engine.step
        engine.rebase(
            step=step,
            schedule=self.make_schedule(step),
            data=self.make_data(step, rank, world),
            group=group,
            replica_group=dp,
        )
        self.duties.lead = self.place.replica == lead_of(gen)
        self.records.membership_epoch = gen.number
        log.warning(
            "stage %d of pipeline instance %d: generation %d (instances %s), on from step %d with "
            "share %d of %d of every batch",
            self.place.stage,
            self.place.replica,
            gen.number,
            ", ".join(map(str, gen.instances)),
            step,
            rank + 1,
            world,
        )

    def _share_losses(self, dp: Group) -> None:
        """The longest loss history among the survivors' last stages (a donor's has the steps it
        applied that the others did not)."""
        mine = len(self.records.losses)
        longest = torch.tensor([float(mine)], dtype=torch.float64)
        dp.allreduce(longest, "max")
        holder = torch.tensor([float(dp.rank if mine == int(longest) else dp.world_size)])
        dp.allreduce(holder, "min")
        src = int(holder)
        marker = [torch.zeros(1)]
        if dp.rank == src:
            broadcast_state(dp, src, {"losses": list(self.records.losses)}, marker)
        else:
            meta, _ = broadcast_state(dp, src, None, None)
            self.records.losses[:] = [float(v) for v in meta["losses"]]


def same_step(group: Group, step: int, whose: str) -> None:
    """Check, over ``group``, that every stage stands at ``step`` after re-forming; StageGroupBroke
    if not (the network or a death cut a step's vote, so some stages applied it)."""
    steps = torch.tensor([float(step), -float(step)], dtype=torch.float64)
    group.allreduce(steps, "max")
    if int(steps[0]) != -int(steps[1]):
        raise StageGroupBroke(
            f"{whose} stages are at different steps after re-forming ({int(-steps[1])}..{int(steps[0])})"
        )


@dataclass
class Regroup:
    """Re-forms the stage group of a job's one pipeline instance (a flushing schedule) in a new
    epoch after it broke with every stage alive (``roles/stage_membership.StageMembership.recover``):
    the stages agree they stand at the same step -- the broken step was applied nowhere -- and
    go on from it on the new group, the step's data and schedule again."""

    place: StagePlace
    engine: StageEngine
    records: StageRecords
    make_data: Callable[[int, int, int], BatchData]  # (first_step, rank, world) -> the share
    make_schedule: Callable[[int], Schedule]  # first step -> the schedule of the remaining steps

    def __call__(self, epoch: int, group: Group) -> None:
        engine = self.engine
        same_step(group, engine.step, f"pipeline instance {self.place.replica}'s")
        step = engine.step
        engine.rebase(
            step=step,
            schedule=self.make_schedule(step),
            data=self.make_data(step, self.place.replica, 1),
            group=group,
            replica_group=None,
        )
        self.records.membership_epoch = epoch
        log.warning(
            "stage %d: its stage group broke with every stage alive; re-formed as %s, on from step %d",
            self.place.stage,
            group.namespace,
            step,
        )
