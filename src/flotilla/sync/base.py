"""The one contract of a synchronisation strategy, what it needs from the loop, and the outcome
of a commit.

A strategy owns everything that happens to the gradients and the weights of one model (a replica,
or a stage) between two step boundaries (bagua's "algorithm = hooks around backward and the
optimizer step", torchft's "a step is committed or dropped").  The loop (``trainer/loop.py``)
runs it per commit unit of ``traits.steps_per_commit`` minibatches::

    strategy.start()                        # once, after the first view (PS: seed + pull 0)
    loop:
        for each minibatch i of the unit:
            strategy.begin_step(step)       # clears gradients, arms hooks (all-reduce buckets)
            forward; (loss_sum / global_batch).backward()
            if i is not the unit's last: strategy.local_step()
        outcome = strategy.synchronize(Proposal(...))
        # committed: the update is applied (atomically) -- discarded: nothing changed
    strategy.before_eval(); evaluate          # rank 0, when evaluation is due
    strategy.finalize(stop)                   # rank 0: the weights of the job's result
    strategy.take_over(stop, chosen)          # any other rank: report the result instead?
    strategy.close()

A strategy's own state (``state_dict`` / ``load_state_dict``: e.g. an outer optimizer's momentum)
travels with the model to joiners and into checkpoints.

What a strategy needs (:class:`Traits`), instead of one "collective" flag, is first of all ONE
agreement regime (:class:`Regime`), the only thing about a strategy the loop machine
(``trainer/loop_machine.py``) reads besides the unit's length:

- ``VOTE`` -- a barrier per unit: one process group per membership view, handed in by ``bind``;
  every member votes at every commit, so the loop's proposals (membership change, stop, strategy
  switch, a local failure) are agreed at the same step by everybody; members join and leave
  (``allreduce``, ``diloco``).
- ``GROUPS`` -- groups formed per unit: no barrier; groups (P-member subsets, pairs) are named
  by an opaque namespace and built through ``StrategyContext.groups`` (or the engine owns its
  own: a pipeline stage).  A broken view is reported and the next one taken between units, never
  waited for (``partial_reduce``).  Members leave; a newcomer is admitted only by a strategy that
  fills it itself (``Traits.takes_newcomers``: partial reduce's first group), else refused.
- ``ALONE`` -- no barrier and no group: each worker commits on its own (through servers: ``ps``)
  and moves to a newer view on its own; members join and leave.

Without a barrier a worker stops or leaves alone, and switches strategy at a step announced in
advance (a ``SwitchAt``).

Failure is data: ``synchronize`` never raises for a failed collective; it returns an
``Outcome`` with ``broken`` (the group is unusable: the loop recovers into a new view) and, where
known, the ``failed`` peers (worker ids).  Invariants: ``synchronize`` either applies the unit's
update completely (``committed``) or not at all; ``close`` is idempotent; after it the strategy
holds no hook on the model.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from flotilla.comm.collective import Group

__all__ = ["VOTE_BYTES", "Outcome", "Proposal", "Regime", "SyncStrategy", "Terms", "Traits", "terms_of"]

# A unit's vote under ``Regime.VOTE`` (``sync/allreduce.py``, ``sync/diloco.py``): one all-reduce
# of [failure, pending epoch, stop, switch] as float64 after the unit's exchange -- a collective
# of its own, whose latency the simulator charges every unit (``sim/vote.py``).
VOTE_BYTES = 4 * 8


class Regime(Enum):
    """How the members of a unit agree (the module doc)."""

    VOTE = "vote"  # a barrier per unit over one group per membership view (bind)
    GROUPS = "groups"  # no barrier: groups formed per unit, by namespace; newcomers: see Traits
    ALONE = "alone"  # no barrier, no group: each worker on its own, members come and go

    @property
    def barrier(self) -> bool:
        return self is Regime.VOTE

    @property
    def elastic(self) -> bool:
        return self is not Regime.GROUPS


@dataclass(frozen=True, slots=True)
class Proposal:
    """What this worker brings to a commit: the newest membership epoch it knows of (0: none),
    whether it wants to stop, a requested strategy switch (an index into the job's switch
    options, 0: none) and whether its own part of the unit went well (``local_ok``: e.g. its
    loss and gradients are finite).  A barrier strategy agrees on the MAX of every field over
    all members (``local_ok``: on the AND)."""

    pending_epoch: int = 0
    stop: bool = False
    switch: int = 0
    local_ok: bool = True
    # the unit's loss as a device tensor not read by the host yet (a strategy whose
    # ``checks_loss_on_device`` is True; else None): its finiteness is part of ``local_ok``
    loss_check: Any = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Outcome:
    """The result of one commit.  ``committed``: the update was applied on every member (or, for
    a strategy without a barrier, on this one / pushed); otherwise it was discarded everywhere
    (``reason``).  ``pending_epoch``/``stop``/``switch``: the agreed proposal (see ``Proposal``).
    ``local_ok``: False when some member reported a local failure (a non-finite loss or gradient),
    which is why the unit was discarded.  ``broken``: the group failed (the loop recovers into a
    new view); ``failed``: the worker ids known to have failed (may be empty: unknown)."""

    committed: bool
    pending_epoch: int = 0
    stop: bool = False
    reason: str = ""
    switch: int = 0
    local_ok: bool = True
    broken: bool = False
    failed: frozenset[int] = field(default_factory=frozenset)

    @staticmethod
    def agreed_alone(proposal: Proposal, committed: bool = True, reason: str = "") -> Outcome:
        """The outcome of a strategy without a barrier: its own proposal is the agreement."""
        return Outcome(
            committed=committed and proposal.local_ok,
            pending_epoch=proposal.pending_epoch,
            stop=proposal.stop,
            switch=proposal.switch,
            local_ok=proposal.local_ok,
            reason=reason or ("" if proposal.local_ok else "non-finite loss or gradient"),
        )

    @staticmethod
    def group_failed(reason: str, failed: frozenset[int] = frozenset()) -> Outcome:
        return Outcome(committed=False, reason=reason, broken=True, failed=failed)


@dataclass(frozen=True, kw_only=True, slots=True)
class Traits:
    """What the loop must know of a strategy (see the module doc): its agreement ``regime`` and
    the minibatches per commit unit; and what the replica engine does for it."""

    regime: Regime = Regime.GROUPS  # (the old default: no barrier, groups per unit)
    steps_per_commit: int = 1
    nominal_batch: bool = False  # scale the loss by the configured global batch, even for a short one
    checks_gradients: bool = False  # synchronize checks the (reduced) gradients for non-finite values
    # a worker that joins the running job without the state is admitted (the strategy gives it
    # the state in ``start``, or the vote's state agreement does); None: ``regime.elastic``
    takes_newcomers: bool | None = None

    def __post_init__(self) -> None:
        if self.steps_per_commit < 1:
            raise ValueError(f"Traits.steps_per_commit must be >= 1, got {self.steps_per_commit}")
        if not isinstance(self.regime, Regime):
            raise ValueError(f"Traits.regime must be one of {[r.name for r in Regime]}, got {self.regime!r}")


class SyncStrategy(ABC):
    """Base class of every strategy (the module doc gives the call order)."""

    kind: str = ""
    traits: Traits = Traits()
    # ``synchronize`` takes the unit's loss as a device tensor (``Proposal.loss_check``) and folds
    # its finiteness into ``local_ok`` itself, so the step reads the loss on the host only after
    # the update was launched (a GPU then runs the step without waiting for the host in between)
    checks_loss_on_device: bool = False
    # how long a finished worker other than rank 0 stays, serving as the one that reports the job's
    # result should its rank 0 die first (``take_over``); 0: it leaves at once (it frees its machine)
    end_wait_s: float = 0.0
    # True: only the finished worker the coordinator names standby stays (``rendezvous.standby``: the
    # last to finish), every other one leaves at once
    end_standby: bool = False

    def bind(self, group: Group | None) -> None:
        """A new membership view: use ``group`` from now on (``Regime.VOTE`` only)."""

    def start(self) -> None:
        """Once, before the first step: e.g. register with servers and pull the initial state."""

    def joined_at(self) -> int:
        """After ``start``: the step a worker that joined mid-run starts at, where the strategy
        decides it (``ps``: the shards' global clock); 0: the engine's own step."""
        return 0

    @abstractmethod
    def begin_step(self, step: int) -> None:
        """Before the forward pass of minibatch ``step``: clear gradients, arm hooks."""

    def defer_reduction(self, defer: bool) -> None:
        """Gradient accumulation (``job.accumulate``): while ``defer``, backward passes only add
        into the gradients; the pass after ``defer_reduction(False)`` completes them (a strategy
        that reduces during backward, ``allreduce``, starts its buckets then).  Default: nothing
        to do (the others read the gradients in ``synchronize`` or ``local_step``)."""

    def local_step(self) -> None:
        """Between the minibatches of one commit unit (``steps_per_commit > 1``)."""
        raise NotImplementedError(f"strategy {self.kind!r} has one minibatch per commit")

    @abstractmethod
    def synchronize(self, proposal: Proposal) -> Outcome:
        """After backward: synchronise and, if committed, apply the update.  Never raises for a
        failed collective: returns ``Outcome.group_failed(...)``."""

    def record_fields(self) -> dict[str, Any]:
        """Strategy-specific fields of the last commit's metrics record."""
        return {}

    def before_eval(self) -> None:
        """Make the model hold the weights to evaluate (PS: the global ones, not a cache)."""

    def checkpoint_state(self) -> bool:
        """A checkpoint fell due on rank 0 of a strategy without a vote: make the model hold the
        job's state and say so (AD-PSGD: the average of the live replicas, as it exports; the
        optimizer's state is rank 0's own), or False: no one worker's state is the job's, and no
        checkpoint is written.  Under a vote every replica holds it already."""
        return False

    def mark_finished(self) -> None:
        """The loop trained this worker's last step (or ``training_done``): closing the strategy
        then ends its part of the job, it does not leave mid-run (PS: no data is dropped)."""

    def data_split(self) -> tuple[int, int] | None:
        """``(rank, world_size)`` that splits the next unit's global batches, where the strategy
        rather than the membership view decides it (PS: shard 0's data views, ``ps/data_views``);
        None: the view's rank and size."""
        return None

    def training_done(self) -> bool:
        """Whether this worker's training is over before its step budget (a strategy without a
        barrier: partial reduce once every partner finished); the loop then ends as at its last
        step (rank 0 evaluates and exports)."""
        return False

    def finalize(self, stop: Callable[[], bool]) -> bool:
        """At the end (rank 0): make the model hold the job's final weights; False if ``stop()``
        interrupted the wait (then there is no result)."""
        return True

    def take_over(
        self, stop: Callable[[], bool], chosen: Callable[[], bool], standby: Callable[[], bool] = lambda: True
    ) -> bool:
        """At the end, on any rank but 0 (after it said it is done): True when this worker
        reports the job's result instead, its model holding the job's final weights.  Waits up
        to ``end_wait_s`` (0: not at all) for the job's end (``stop()``), and takes over when the
        coordinator names it (``chosen()``: the rank 0 died before reporting and no worker trains
        any more, ``rendezvous.reporter``): it then finalizes as rank 0 would.  With
        ``end_standby`` it leaves as soon as it is not the coordinator's standby (``standby()``:
        a later finisher is).  AD-PSGD has its own rule (``sync/adpsgd_end.py``)."""
        deadline = time.monotonic() + self.end_wait_s
        while not stop() and time.monotonic() < deadline:
            if chosen():
                return self.finalize(stop)
            if self.end_standby and not standby():
                return False
            time.sleep(0.05)
        return False

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The strategy's own state at a step boundary (e.g. an outer optimizer's momentum), as
        named tensors: sent to a joiner with the model (``trainer/state_sync.py``), written to
        checkpoints and restored on ``--resume``.  It must be the same on every member of a view
        after a committed unit (it travels from one donor).  Default: no state."""
        return {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take the state :meth:`state_dict` gave (on a joiner, or when resuming)."""
        if state:
            raise ValueError(f"strategy {self.kind!r} keeps no state of its own, got {sorted(state)}")

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This worker's OWN state, which differs between members (e.g. DiLoCo's inner optimizer
        state): every rank writes it beside rank 0's checkpoint, and a resumed worker of the same
        rank in a view of the same size takes it back.  Default: none."""
        return {}

    def load_local_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take back what :meth:`local_state_dict` gave (on ``--resume``).  It is called before the
        first view forms, whose state agreement may still hand every member a donor's state: a
        strategy applies it in :meth:`start` (after that agreement)."""
        if state:
            raise ValueError(f"strategy {self.kind!r} keeps no local state, got {sorted(state)}")

    def close(self) -> None:
        """Release hooks, connections; idempotent."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Terms:
    """A strategy's declaration as the loop machine (``trainer/loop_machine.py``) and the
    replica engine take it: its traits and its kind, read in one place (``terms_of``)."""

    regime: Regime
    steps_per_commit: int
    nominal_batch: bool
    checks_gradients: bool
    name: str
    takes_newcomers: bool = True  # (Traits.takes_newcomers: a late joiner is admitted)


def terms_of(strategy: SyncStrategy) -> Terms:
    """The one read of a strategy's declaration outside ``sync/``: everything the loop does
    differently for a strategy follows from these terms, in pure code."""
    t = strategy.traits
    return Terms(
        regime=t.regime,
        steps_per_commit=t.steps_per_commit,
        nominal_batch=t.nominal_batch,
        checks_gradients=t.checks_gradients,
        name=strategy.kind,
        takes_newcomers=t.regime.elastic if t.takes_newcomers is None else t.takes_newcomers,
    )
