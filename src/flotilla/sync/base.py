"""The one contract of a data-parallel synchronisation strategy, and the outcome of a commit.

A strategy owns everything that happens to the gradients and the weights of one replica between
two step boundaries (bagua's "algorithm = hooks around backward and the optimizer step", torchft's
"a step is committed or dropped").  The worker role (``roles/worker.py``) runs ONE loop over this
contract, per commit unit of ``traits.steps_per_commit`` minibatches::

    strategy.start()                        # once, after the first view (PS: seed + pull 0)
    loop:
        for each minibatch i of the unit:
            strategy.begin_step(step)       # clears gradients, arms hooks (all-reduce buckets)
            forward; (loss_sum / global_batch).backward()
            if i is not the unit's last: strategy.local_step()
        outcome = strategy.synchronize(pending_epoch=..., stop=...)
        # committed: the update is applied (atomically) -- discarded: nothing changed -- stop
    strategy.before_eval(); evaluate          # rank 0, every job.eval_every_steps
    strategy.finalize(stop)                   # rank 0: the weights of the job's result
    strategy.close()

View changes (``traits.collective``): a collective strategy is bound to a process group per
membership view (``bind``), votes on ``pending_epoch``/``stop`` at every commit so every replica
changes view or stops at the same boundary, and a replica without state receives a donor's model
and optimizer state from the role (``sync/plan.choose_donor``).  A non-collective strategy (the PS
path) brings its own state (it pulls the global weights in ``start``), keeps a fixed membership
and stops locally when asked.

Invariants: ``synchronize`` either applies the unit's update completely (``committed``) or not at
all; it raises :class:`~flotilla.core.errors.CollectiveError` only with nothing applied.
``close`` is idempotent; after it the strategy holds no hook on the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flotilla.comm.collective import EpochGroup

__all__ = ["Outcome", "SyncStrategy", "Traits"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """The result of one commit.  ``committed``: the update was applied on every replica (or, for
    a non-collective strategy, pushed); otherwise it was discarded everywhere (``reason``).
    ``pending_epoch``: the newest membership epoch any replica knows of (0: none); ``stop``: some
    replica asked to stop at this boundary."""

    committed: bool
    pending_epoch: int = 0
    stop: bool = False
    reason: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Traits:
    """What the worker role must do for a strategy (see the module doc)."""

    collective: bool
    steps_per_commit: int = 1
    nominal_batch: bool = False  # scale the loss by the configured global batch, even for a short one

    def __post_init__(self) -> None:
        if self.steps_per_commit < 1:
            raise ValueError(f"Traits.steps_per_commit must be >= 1, got {self.steps_per_commit}")


class SyncStrategy(ABC):
    """Base class of every strategy (the module doc gives the call order)."""

    kind: str = ""
    traits: Traits = Traits(collective=False)

    def bind(self, group: EpochGroup | None) -> None:
        """A new membership view: use ``group`` from now on (collective strategies only)."""

    def start(self) -> None:
        """Once, before the first step: e.g. register with servers and pull the initial state."""

    @abstractmethod
    def begin_step(self, step: int) -> None:
        """Before the forward pass of minibatch ``step``: clear gradients, arm hooks."""

    def local_step(self) -> None:
        """Between the minibatches of one commit unit (``steps_per_commit > 1``)."""
        raise NotImplementedError(f"strategy {self.kind!r} has one minibatch per commit")

    @abstractmethod
    def synchronize(self, *, pending_epoch: int = 0, stop: bool = False) -> Outcome:
        """After backward: synchronise and, if committed, apply the update."""

    def record_fields(self) -> dict[str, Any]:
        """Strategy-specific fields of the last commit's metrics record."""
        return {}

    def before_eval(self) -> None:
        """Make the model hold the weights to evaluate (PS: the global ones, not a cache)."""

    def finalize(self, stop: Callable[[], bool]) -> bool:
        """At the end (rank 0): make the model hold the job's final weights; False if ``stop()``
        interrupted the wait (then there is no result)."""
        return True

    def close(self) -> None:
        """Release hooks, connections; idempotent."""
