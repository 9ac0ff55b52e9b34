"""What a lost pipeline instance's return takes (``launch/pipeline_instances.InstanceWatch``
decides when; this, what it costs).  No I/O, no clock.

- A return after a stage of the instance failed of its own cause takes one of the attempt's
  **budget** (``job.max_restarts``): a stage that crashes again on the same device and cut would
  otherwise come back for ever.
- A return after a loss **nobody caused** (the instance's group broke under it: the network, a
  frozen stage) is **free**, up to ``FREE_RETURNS`` such returns in a job (then they take the
  budget too).
- A return that **forms the instance again** on other devices (the strategy re-forms:
  ``launch/pipeline_reform.py``) is free, without a cap: each leaves the device whose stage failed
  out, so a crash cannot loop (devices run out; a revocation schedule's adds bound the rest) -- as
  a revoked worker takes nothing under the data-parallel strategies.

A return given up for a reason that is not its newcomers' fault (another instance was lost
meanwhile, a group broke) is **refunded**: what it took is given back for its next try.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from flotilla.launch.pipeline_instance_log import InstanceLog

__all__ = ["FREE_RETURNS", "Returns"]

FREE_RETURNS = 32  # returns after losses nobody caused, in a job, before they take the budget too


@dataclass
class Returns:
    """The budget of one attempt's returns (module doc).  ``culprits``, where asked: lost instance
    -> the stage process whose own failure lost it (None: nobody's)."""

    budget: int  # returns that take from job.max_restarts, still allowed in this attempt
    history: InstanceLog  # (the job's: its free_returns count every attempt's)
    reforming: bool = False  # the strategy forms a lost instance again on other devices
    free: set[int] = field(default_factory=set)  # lost instances whose return is free: nobody failed
    reformed: set[int] = field(default_factory=set)  # formed again, their return given up: tried again

    def lost(self, instance: int, *, nobody_failed: bool) -> None:
        if nobody_failed:
            self.free.add(instance)

    def reforms(self, instance: int, culprits: Mapping[int, str | None]) -> bool:
        """Whether ``instance``'s return forms it again on other devices (free)."""
        return self.reforming and (culprits.get(instance) is not None or instance in self.reformed)

    def _frees(self) -> bool:
        return self.history.free_returns < FREE_RETURNS

    def able(self, instance: int, culprits: Mapping[int, str | None]) -> bool:
        """Whether lost ``instance`` may be tried now (what its return would take is there)."""
        return (
            self.budget >= 1 or (self._frees() and instance in self.free) or self.reforms(instance, culprits)
        )

    def any_able(
        self, waiting: Iterable[int], culprits: Mapping[int, str | None], *, just_lost: bool | None = None
    ) -> bool:
        """Whether one of the ``waiting`` instances may come back; ``just_lost``: one more, not yet
        waiting, was lost by nobody's fault (True) or by a stage's own failure (False)."""
        if just_lost is not None and (
            self.budget >= 1 or (just_lost and self._frees()) or (not just_lost and self.reforming)
        ):
            return True
        return any(self.able(i, culprits) for i in waiting)

    def pay(self, instance: int, *, reformed: bool) -> bool:
        """``instance`` comes back: take what its return costs; True if it was a free return."""
        free = instance in self.free and self._frees() and not reformed
        self.free.discard(instance)
        self.reformed.discard(instance)
        if free:
            self.history.free_returns += 1
        elif not reformed:
            self.budget -= 1
        return free

    def refund(self, instance: int, *, free: bool, reformed: bool) -> None:
        """The return of ``instance`` was given up, not by its newcomers' fault: give back what it took."""
        if reformed:
            self.reformed.add(instance)
        elif free:
            self.free.add(instance)
            self.history.free_returns -= 1
        else:
            self.budget += 1
