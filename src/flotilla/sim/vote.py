"""Strategies whose members vote on every unit (``allreduce``, ``diloco``) in virtual time.

Under a vote every member takes the same decisions at the same step (the loop machine's property,
``tests/unit/test_loop_machine.py``), so the simulator drives **one** loop machine
(``trainer/loop_machine.py``, unchanged) for the agreed view and models what the members do:

- a unit of ``k`` steps (``VoteSpec.inner_steps``; 1 for all-reduce) lasts the slowest live
  member's compute -- per step under all-reduce (a barrier every step), summed over the ``k``
  local steps under DiLoCo -- plus the ring all-reduce of the model's bytes (every step, or once
  per unit) and the unit's vote (a second, small all-reduce of ``sync.base.VOTE_BYTES``) over the
  slowest link among the members (``cluster/comm_cost.py``);
- a member revoked during a unit breaks it: the survivors notice ``Recovery.detect_s`` after the
  revocation, the machine recovers (``Recover`` -> the next view, ``repair_s``) and, under
  ``on_abort: redo``, runs the unit again;
- an arrival is ready ``startup_s`` later; the next unit's vote carries the pending view, and
  after it commits the machine moves to it (``MoveTo``): ``repair_s`` plus sending the newcomers
  the model (one transfer of its bytes);
- checkpoints and evaluations cost ``SimJob.checkpoint_s`` / ``eval_s`` where the machine's
  boundary rule puts them.

What is not modelled yet: overlap of the all-reduce with the backward pass, a lost state's restart
from a checkpoint (every worker revoked ends the simulation, ``completed`` false).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flotilla.cluster.comm_cost import ring_allreduce_s, transfer_s
from flotilla.sim.members import Members
from flotilla.sim.model import Change, Recovery, SimCluster, SimJob, SimResult
from flotilla.sync.base import VOTE_BYTES, Outcome, Regime, Terms
from flotilla.trainer import loop_events as ev
from flotilla.trainer import loop_machine as lm
from flotilla.trainer.boundary import BoundaryPolicy

__all__ = ["VoteSpec", "allreduce_of", "diloco_of", "simulate_vote"]


@dataclass(frozen=True, kw_only=True, slots=True)
class VoteSpec:
    """``name`` (the strategy's kind); ``inner_steps``: steps per unit (DiLoCo's H; 1: all-reduce,
    whose members reduce every step)."""

    name: str = "allreduce"
    inner_steps: int = 1
    on_abort: str = "redo"

    def __post_init__(self) -> None:
        if not isinstance(self.inner_steps, int) or self.inner_steps < 1:
            raise ValueError(f"VoteSpec.inner_steps must be an integer >= 1, got {self.inner_steps!r}")

    def simulate(
        self, job: SimJob, cluster: SimCluster, *, changes: tuple[Change, ...] | list[Change] = (),
        recovery: Recovery = Recovery(),
    ) -> SimResult:  # fmt: skip
        return simulate_vote(job, cluster, self, changes=changes, recovery=recovery)


def allreduce_of(settings: Any) -> VoteSpec:
    """``strategy: {kind: allreduce}`` (``StrategySpec.simulated``; the settings read by name)."""
    return VoteSpec(name="allreduce", on_abort=str(getattr(settings, "on_abort", "redo")))


def diloco_of(settings: Any) -> VoteSpec:
    """``strategy: {kind: diloco, inner_steps: H}``."""
    return VoteSpec(
        name="diloco",
        inner_steps=int(settings.inner_steps),
        on_abort=str(getattr(settings, "on_abort", "redo")),
    )


class _Run:
    """One simulation: the machine's queries answered in modelled time."""

    def __init__(self, job: SimJob, cluster: SimCluster, spec: VoteSpec, members: Members) -> None:
        self.job, self.cluster, self.spec, self.m = job, cluster, spec, members
        self.t, self.epoch, self.step, self.events = 0.0, 1, 0, 0
        self.rngs = {n: cluster.rng_of(i) for n, i in members.index.items()}
        self.samples = 0
        self.timeline: list[tuple[float, int, int]] = []
        self.recoveries: list[float] = []
        self._unrecovered: list[float] = []  # revocations waiting for the next committed unit
        self.note = ""

    def view(self) -> ev.ViewFacts:
        return ev.ViewFacts(self.epoch, 0, max(1, len(self.m.live)))

    def _rng(self, name: str):  # (a new worker id draws its own)
        if name not in self.rngs:
            self.rngs[name] = self.cluster.rng_of(self.m.index[name])
        return self.rngs[name]

    def unit_s(self, first: int, last: int) -> float:
        """The unit's duration with the current members (see the module doc)."""
        live = list(self.m.live.values())
        k = last - first + 1
        link = self.cluster.link_among(live)
        comm = ring_allreduce_s(len(live), self.job.model_bytes, link) + ring_allreduce_s(
            len(live), VOTE_BYTES, link
        )
        if self.cluster.slowdown is None:  # (no draws: every step the same; the slowest device paces)
            slowest = self.job.step_s / min(d.speed for d in live)
            return k * (slowest + comm) if self.spec.inner_steps == 1 else k * slowest + comm
        if self.spec.inner_steps == 1:  # a barrier every step: the slowest member of each step
            total = 0.0
            for _ in range(k):
                total += (
                    max(self.cluster.compute_s(self.job.step_s, d, self._rng(d.name)) for d in live) + comm
                )
            return total
        per_member = [
            sum(self.cluster.compute_s(self.job.step_s, d, self._rng(d.name)) for _ in range(k)) for d in live
        ]
        return max(per_member) + comm

    def run_unit(self, e: ev.RunUnit) -> ev.UnitDone:
        self.m.advance(self.t)
        if not self.m.live:
            raise _Lost
        end = self.t + self.unit_s(e.first_step, e.last_step)
        kill = self.m.next_kill(end)
        if kill is not None:  # a member revoked before or during the unit: it breaks
            self.t = max(self.t, kill.at_s + self.m.recovery.detect_s)
            self.m.advance(kill.at_s)
            self._unrecovered.append(kill.since_s)
            failed = frozenset({self.m.index[kill.name]})
            return ev.UnitDone(Outcome.group_failed("a member was revoked", failed), now_s=self.t)
        self.t = end
        k = e.last_step - e.first_step + 1
        self.samples += k * len(self.m.live) * self.job.batch_per_worker
        self.timeline.append((self.t, e.last_step + 1, len(self.m.live)))
        self.recoveries += [self.t - at for at in self._unrecovered]
        self._unrecovered = []
        p = e.proposal
        return ev.UnitDone(Outcome(committed=True, pending_epoch=p.pending_epoch, stop=p.stop), now_s=self.t)

    def answer(self, e: ev.Effect) -> ev.Event | None:
        """The modelled answer to a query (None: the run ended)."""
        rec = self.m.recovery
        match e:
            case ev.AskFirstView():
                return ev.FirstView(self.view(), initial=True, step=0, has_state=True)
            case ev.Restore():
                return ev.Restored(0)
            case ev.Build():
                regime = Regime.VOTE
                terms = Terms(regime=regime, steps_per_commit=self.spec.inner_steps, nominal_batch=False,
                              checks_gradients=False, name=self.spec.name)  # fmt: skip
                return ev.Built(terms)
            case ev.EnterView():
                return ev.Entered(self.step, has_state=True)
            case ev.Poll():
                self.m.advance(self.t)
                pending = self.epoch + 1 if self.m.ready(self.t) else 0
                return ev.Polled(pending_epoch=pending)
            case ev.RunUnit():
                return self.run_unit(e)
            case ev.Recover():
                self.t += rec.repair_s
                self.m.advance(self.t)
                if not self.m.live:
                    raise _Lost
                self.epoch += 1
                return ev.ViewGiven(self.view())
            case ev.MoveTo(epoch=epoch):
                joiners = self.m.ready(self.t)
                self.m.admit(joiners)
                link = self.cluster.link_among(list(self.m.live.values()))
                self.t += rec.repair_s + (transfer_s(self.job.model_bytes, link) if joiners else 0.0)
                self.epoch = epoch
                return ev.Moved(self.view())
            case ev.CatchUp():
                return ev.CaughtUp(self.view())
        return None

    def actions(self, effects: list[ev.Effect]) -> None:
        for e in effects:
            match e:
                case ev.SetStep(step=step):
                    self.step = step
                case ev.Checkpoint():
                    self.t += self.job.checkpoint_s
                case ev.Evaluate():
                    self.t += self.job.eval_s


class _Lost(Exception):
    """Every worker that held the model was revoked."""


def simulate_vote(
    job: SimJob,
    cluster: SimCluster,
    spec: VoteSpec = VoteSpec(),
    *,
    changes: tuple[Change, ...] | list[Change] = (),
    recovery: Recovery = Recovery(),
    policy: BoundaryPolicy | None = None,
) -> SimResult:
    """Simulate ``job`` under a voting strategy (see the module doc)."""
    policy = policy or BoundaryPolicy(
        total_steps=job.steps,
        on_abort=spec.on_abort,
        eval_every_steps=job.eval_every_steps,
        checkpoint_every_steps=job.checkpoint_every_steps,
    )
    run = _Run(job, cluster, spec, Members(cluster, changes, recovery))
    state, effects = lm.start(policy, worker=0)
    completed = False
    try:
        while True:
            run.events += 1
            run.actions(effects[:-1])
            last = effects[-1]
            if isinstance(last, ev.Finish):
                completed = last.step >= job.steps
                break
            if isinstance(last, ev.Exit | ev.Refuse):
                run.note = getattr(last, "message", f"exit {getattr(last, 'code', '?')}")
                break
            answer = run.answer(last)
            if answer is None:
                raise AssertionError(f"simulate_vote: no answer to {last!r}")
            state, effects = lm.step(state, answer)
    except _Lost:
        run.note = "every worker holding the model was revoked (a restart from a checkpoint is not modelled)"
    run.m.close(run.t)
    return SimResult(
        strategy=spec.name,
        steps=run.step,
        time_s=run.t,
        completed=completed,
        device_s=run.m.device_s,
        cost=run.m.cost,
        samples=run.samples,
        timeline=run.timeline,
        recoveries_s=run.recoveries,
        events=run.events,
        note=run.note,
    )
