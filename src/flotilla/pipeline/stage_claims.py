"""Which stage process each stage worker of a hosted pipeline job runs (pure: no I/O, no clock).

A pipeline job whose stages are started by hand or by a scheduler (``flotilla coordinator`` on one
host, ``flotilla worker`` on each: ``docs/multihost.md``) has ``R * P`` stage processes; process
``g`` is stage ``g % P`` of pipeline instance ``g // P`` and is named ``cluster.workers[g].name``
(``pipeline/replicas.py``).  A stage worker names the process it runs by its worker name, or by
its stage index and pipeline instance (``--stage I --instance R``), or both (they must agree).

:class:`StageClaims` is the host's record of who claimed which process:

- :meth:`StageClaims.place_of` turns what a worker said into the process it runs, or refuses it
  with one line naming the job's stage processes (an unknown name, a stage or instance index out
  of range, a name that is not that stage's);
- :meth:`StageClaims.claim` gives it the process, or refuses a second worker claiming a process
  already held (naming the holder); the same worker asking again with its own ``token`` (a lost
  reply, sent again) gets the same claim;
- :meth:`StageClaims.beat` and :meth:`StageClaims.silent`: the holders' liveness, by the times
  the caller feeds in (a holder silent past the heartbeat timeout is lost: no one else may take
  its process, the stage group it was part of is broken);
- :meth:`StageClaims.release`: a launcher that saw a holder die and starts a newcomer in its
  place frees its process first (nobody else does: a process is never taken from a live holder).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flotilla.core.errors import ConfigError
from flotilla.pipeline.layout import Layout

__all__ = ["Claim", "ClaimRefused", "StageClaims"]


class ClaimRefused(ConfigError):
    """A stage worker's claim refused: one line naming what it asked for and what the job has."""


@dataclass(frozen=True, slots=True)
class Claim:
    """Stage process ``index`` held by the worker of ``token`` (``pid`` on ``host``)."""

    index: int
    token: str
    pid: int
    host: str
    at_s: float


class StageClaims:
    """The stage processes of one job and who holds each (module doc)."""

    def __init__(self, names: Sequence[str], layout: Layout) -> None:
        if len(names) != layout.num_processes:
            raise ValueError(f"{len(names)} stage processes for a layout of {layout.num_processes}")
        self.names, self.layout = tuple(names), layout
        self.num_instances = layout.num_instances
        self.claims: dict[int, Claim] = {}
        self.last_beat: dict[int, float] = {}

    def extend(self, names: Sequence[str], layout: Layout) -> None:
        """The job's processes after an instance was formed again on new ones (``Layout.reformed``:
        the old names and places kept, new ones appended); the claims held stay."""
        if len(names) != layout.num_processes or tuple(names[: len(self.names)]) != self.names:
            raise ValueError(f"{len(names)} stage processes do not extend {len(self.names)} for its layout")
        self.names, self.layout = tuple(names), layout

    def describe(self, index: int) -> str:
        """``w1 (stage 1 of instance 0)``."""
        return self.layout.describe(index, self.names)

    def listing(self) -> str:
        return ", ".join(self.describe(g) for g in range(len(self.names)))

    def place_of(self, name: str | None, stage: int | None, instance: int | None) -> int:
        """The stage process a worker asked for (module doc); ClaimRefused otherwise."""
        r = self.num_instances
        if stage is None and instance is not None:
            raise ClaimRefused(f"instance {instance} given without a stage index: give --stage too")
        if stage is not None:
            inst = 0 if instance is None else instance
            if not 0 <= inst < r:
                raise ClaimRefused(
                    f"pipeline instance {inst} is not in this job: it runs {r} instance(s) "
                    f"(0..{r - 1}); the stage processes are {self.listing()}"
                )
            p = self.layout.counts[inst]
            if not 0 <= stage < p:
                which = "its pipelines have" if self.layout.is_uniform else f"instance {inst} has"
                raise ClaimRefused(
                    f"stage index {stage} is not in this job: {which} {p} stage(s) "
                    f"(0..{p - 1}); the stage processes are {self.listing()}"
                )
            index = self.layout.first(inst) + stage
            if name is not None and name != self.names[index]:
                raise ClaimRefused(
                    f"worker {name!r} asked for stage {stage} of instance {inst}, which is "
                    f"{self.describe(index)}: give one of the two, or both matching"
                )
            return index
        if name is None:
            raise ClaimRefused(
                f"a stage worker needs a name or a stage index; the stage processes are {self.listing()}"
            )
        if name not in self.names:
            raise ClaimRefused(
                f"worker {name!r} is not a stage of this job: the stage processes are {self.listing()}"
            )
        index = self.names.index(name)
        if not self.layout.current(index):
            raise ClaimRefused(f"{self.describe(index)}: its instance was formed again on other processes")
        return index

    def claim(self, index: int, token: str, pid: int, host: str, now_s: float) -> Claim:
        """Stage process ``index`` for the worker of ``token``; ClaimRefused when another holds it."""
        held = self.claims.get(index)
        if held is not None and held.token != token:
            raise ClaimRefused(
                f"{self.describe(index)} is already claimed by the worker with pid {held.pid} on "
                f"{held.host}: two workers cannot run one stage"
            )
        if held is None:
            held = self.claims[index] = Claim(index, token, pid, host, now_s)
        self.last_beat[index] = now_s
        return held

    def release(self, index: int) -> None:
        """Stage process ``index`` is free again: its holder is gone and a launcher that can start
        a newcomer for it is about to (a pipeline instance coming back, ``pipeline/replicas.py``)."""
        self.claims.pop(index, None)
        self.last_beat.pop(index, None)

    def holds(self, index: int, token: str) -> bool:
        held = self.claims.get(index)
        return held is not None and held.token == token

    def beat(self, index: int, token: str, now_s: float) -> bool:
        """A holder's sign of life (False: ``token`` does not hold ``index``: ignored)."""
        if not self.holds(index, token):
            return False
        self.last_beat[index] = now_s
        return True

    def all_claimed(self) -> bool:
        return not self.missing()

    def missing(self) -> list[int]:
        """The processes of the instances now that nobody holds (retired ones are nobody's)."""
        return [g for g in range(len(self.names)) if g not in self.claims and self.layout.current(g)]

    def silent(self, now_s: float, timeout_s: float, done: Sequence[int] = ()) -> list[int]:
        """Holders silent for more than ``timeout_s`` (not counting those in ``done``)."""
        return [g for g, t in self.last_beat.items() if g not in done and now_s - t > timeout_s]
