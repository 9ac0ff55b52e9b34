"""Strategy ``adaptive`` (``sync/adaptive.py``, SPEC §7) in virtual time (``docs/simulator.md``).

The run is cut into **segments**, each simulated by its target's own hook (``StrategySpec.simulated``
of the target's kind: ``sim/vote.py``, ``sim/adpsgd.py``, ``sim/partial_reduce.py``):

1. at the start the policy's choice for the cluster as configured (``first_match`` on the devices'
   count and the spread of their speeds: ``AdaptiveStrategy.initial(initial_metrics(speeds))``);
2. the segment's target is simulated for the remaining steps on the devices live then, with the
   later changes on the segment's clock (``sim/adaptive_view.Roster.segment``);
3. the coordinator's policy looks every ``every_s`` (ticks at ``k * every_s`` on the run's clock,
   ``AdaptiveService._run``) at its snapshot (``sim/adaptive_view``: live workers, their paces, the
   losses) and calls the runtime's ``decide`` with the most advanced worker's step (the segment's
   timeline) and the last switch's announced step (the dwell, counted in steps as the runtime
   counts); a tick that finds a live worker unmeasured is skipped (``_unmeasured``).  Only the
   ticks just after an instant the snapshot changes, and the one where the dwell ends, can decide
   otherwise than the tick before: only those are evaluated;
4. a switch is announced for ``switch_announce.announce_step`` (every live worker's step plus its
   rate over ``lead_s``; the segment's rate over its last units) -- refused, as the runtime's
   ``SwitchAnnouncer``, at or past the job's end and after ``max_switches``; the news reaches the
   workers with the next heartbeat's reply (``heartbeat_s`` + ``SimCluster.message_s`` of its
   header): the switch takes effect at the first boundary of the segment's timeline at or past
   the announced step whose unit began once the news was known (a worker reads it when it polls;
   under a vote it rides the unit's vote; DiLoCo's unit ends at or past it);
5. the segment is simulated again up to that step (what a simulation does before an instant does
   not depend on what comes after); its end is when every worker reached it (a simulated AD-PSGD
   run ends with a consensus all-reduce that a switch does not run: ``ADPSGD.close`` is not
   ``finalize``; it is taken out), the switch costs :func:`switch_terms`, and the next segment
   starts then.

**Switch cost** (:func:`switch_terms`), what a worker does between the step it switches at and the
next target's first unit (``trainer/loop_machine._switch``: ``CloseStrategy``, ``Build``,
``EnterView``; ``trainer/loop_actions.enter_view``):

- ``pr_leave``: leaving partial reduce, ``PartialReduce.close`` calls ``pr_leave`` on the
  coordinator and waits for the answer: two message-plane messages (``message_s``);
- into a vote (``allreduce``, ``diloco``), ``state_sync.agree_state`` on the view's group:
  ``group`` -- the group is formed for the view (``roles/view_groups.group``; none was held under
  a strategy without a vote): ``Recovery.repair_s``, what ``sim/vote.py`` charges a view;
  ``probe`` -- one all-reduce of 4 float64; ``average`` -- coming from replicas that drifted
  apart (no vote before), ``Engine.average`` all-reduces the model (``sync/state.average_weights``);
  ``state`` -- a switch enters with ``wanted`` (``loop_machine._built``), so ``choose_donor``
  transfers: the donor's all-reduce (one float32) and ``comm/state_transfer.broadcast_state``'s three
  broadcasts (length, header, tensors: the model and its optimizer state,
  ``(SimJob.optimizer_multiplier - 1) * model_bytes``), each modelled as one transfer over the
  ring's slowest link (as ``sim/vote.py`` sends a newcomer the model; optimistic beyond 2 members);
- into ``adpsgd`` or ``partial_reduce``: nothing (``Build`` registers handlers locally; ``start``
  sends nothing for a worker that holds the state);
- the announcement itself costs no time on the workers' path: it rides heartbeat replies ahead of
  the step (the lead), and only delays the switch when it would arrive late (step 4).

**Joined result**: steps, time, samples, recoveries and the timeline are the segments' (shifted);
``device_s``/``cost`` are the run's devices from their start or arrival to their revocation or the
end (``sim/members.Members`` over the whole change list); ``events``: every simulation run;
``note``: ``allreduce -> adpsgd at step 412 (t=83.1 s, 5 workers, switch 1.2 ms)`` per switch,
then each segment's own note.  No switch: the target's own result, relabelled.

Not modelled: the policy reads each worker's nominal pace (no slowdown draws, no smoothing) and
the steps without the heartbeats' lag; under AD-PSGD and partial reduce the "most advanced" step is
the segment's timeline (rank 0's, the most advanced worker's); a switch out of a strategy without a
barrier starts the next target when the last worker reached the step (the runtime's fast workers
start alone, earlier; AD-PSGD's truncated run ends a laggard early, as at the job's end); each
segment's evaluations and checkpoints fall every ``eval_every_steps`` from its own first step; the
slowdown draws start again in each segment; ``Build``'s host time.  A newcomer is measured one
step's pace after it joined (its admission into the running strategy is not waited for); a device
that joined before the switch is a member of the next segment from its start (the old segment may
not have admitted it yet); a revocation during the switch breaks the next segment's first unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from flotilla.cluster import adaptive_policy as policy
from flotilla.cluster.comm_cost import ring_allreduce_s, transfer_s
from flotilla.core.errors import ConfigError
from flotilla.sim.adaptive_view import Found, PolicySpec, Roster, Segment, next_switch
from flotilla.sim.adpsgd import ADPSGDSpec
from flotilla.sim.members import Members
from flotilla.sim.model import Change, Recovery, SimCluster, SimDevice, SimJob, SimResult
from flotilla.sim.pr_spec import PRSpec
from flotilla.sim.vote import VoteSpec

__all__ = [
    "AdaptiveSpec",
    "Switch",
    "Target",
    "adaptive_of",
    "simulate_adaptive",
    "switch_terms",
]

_CONTROL_BYTES = 256  # a controller message (pr_leave and its answer; sim/partial_reduce's size)
_PROBE_BYTES = 32  # state_sync.agree_state's probe: 4 float64
_DONOR_BYTES = 4  # ... and its donor's rank: 1 float32
_LENGTH_BYTES = 8  # broadcast_state's length: 1 int64 (then its header: a few hundred bytes, ~0)


@dataclass(frozen=True, slots=True)
class Target:
    """A target strategy: its kind and its simulated form (its spec's ``simulated`` hook)."""

    kind: str
    sim: Any

    @property
    def votes(self) -> bool:
        return isinstance(self.sim, VoteSpec)


@dataclass(frozen=True, kw_only=True, slots=True)
class Switch:
    """A switch the policy made: decided at ``decided_s`` (``why``, rule ``rule``), announced for
    ``announced_step``, taken at ``step`` once every worker reached it (``at_s``); the next target
    starts at ``start_s`` (``at_s`` plus ``terms``, in seconds)."""

    came: str
    went: str
    rule: int
    why: str
    num_workers: int
    decided_s: float
    announced_step: int
    step: int
    at_s: float
    start_s: float
    terms: tuple[tuple[str, float], ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class AdaptiveSpec:
    """The policy (``sim/adaptive_view.PolicySpec``: its rules name indices of ``targets``) and the
    target strategies' simulated forms; ``name``: the result's label."""

    policy: PolicySpec
    targets: tuple[Target, ...]
    name: str = "adaptive"

    def __post_init__(self) -> None:
        bad = [r.target for r in self.policy.rules if not 0 <= r.target < len(self.targets)]
        if not self.targets or bad:
            raise ValueError(
                f"AdaptiveSpec.targets: the rules name target {bad[0] if bad else 0}; "
                f"there are {len(self.targets)}"
            )

    def simulate(
        self, job: SimJob, cluster: SimCluster, *, changes: Sequence[Change] = (),
        recovery: Recovery = Recovery(),
    ) -> SimResult:  # fmt: skip
        return simulate_adaptive(job, cluster, self, changes=changes, recovery=recovery)


def adaptive_of(settings: Any) -> AdaptiveSpec:
    """``strategy: {kind: adaptive, rules, dwell_steps, every_s, window_s}`` (``StrategySpec.simulated``):
    each target through its own kind's hook; ValueError naming a target that has none."""
    from flotilla.core.imports import import_by_name
    from flotilla.sync import registry  # (not at import: it loads torch; the settings came through it)

    targets = []
    for i, t in enumerate(settings.targets()):
        spec = registry.spec_of(t.kind)
        if not spec.simulated:
            raise ValueError(
                f"strategy adaptive: target {i + 1} ({t.kind}) is not simulated yet (its spec has no "
                "`simulated` hook)"
            )
        make = import_by_name(spec.simulated, label=f"strategy {t.kind}: simulated", error=ConfigError)
        targets.append(Target(t.kind, make(t)))
    looks = PolicySpec(
        rules=tuple(settings.policy()), dwell_steps=int(settings.dwell_steps),
        every_s=float(settings.every_s), window_s=float(settings.window_s),
    )  # fmt: skip
    return AdaptiveSpec(policy=looks, targets=tuple(targets))


def switch_terms(
    came: Target, went: Target, job: SimJob, cluster: SimCluster, devices: list[SimDevice],
    recovery: Recovery,
) -> dict[str, float]:  # fmt: skip
    """What a switch from ``came`` to ``went`` costs on ``devices`` (the module doc names where
    each term comes from in the runtime), in seconds."""
    n = len(devices)
    if n == 0:
        return {}
    link = cluster.link_among(devices)
    terms: dict[str, float] = {}
    if isinstance(came.sim, PRSpec):
        terms["pr_leave"] = 2 * cluster.message_s(_CONTROL_BYTES, devices)
    if went.votes:
        if not came.votes:
            terms["group"] = recovery.repair_s
        terms["probe"] = ring_allreduce_s(n, _PROBE_BYTES, link)
        if not came.votes:
            terms["average"] = ring_allreduce_s(n, job.model_bytes, link)
        if n > 1:
            state = (job.optimizer_multiplier - 1) * job.model_bytes
            broadcasts = transfer_s(_LENGTH_BYTES, link) + transfer_s(0, link) + transfer_s(state, link)
            terms["state"] = ring_allreduce_s(n, _DONOR_BYTES, link) + broadcasts
    return terms


# ---------------------------------------------------------------------- the run
@dataclass(slots=True)
class _Run:
    """Where the run stands: the running target, the last switch's announced step, the segment's
    start (time, step), devices and changes."""

    running: int
    last: int | None
    t0: float
    s0: int
    cluster: SimCluster
    changes: list[Change]

    def simulate(self, target: Target, job: SimJob, steps: int, recovery: Recovery) -> SimResult:
        part = replace(job, steps=steps)
        result: SimResult = target.sim.simulate(part, self.cluster, changes=self.changes, recovery=recovery)
        return result


def simulate_adaptive(
    job: SimJob, cluster: SimCluster, spec: AdaptiveSpec, *, changes: Sequence[Change] = (),
    recovery: Recovery = Recovery(), record: list[Switch] | None = None,
) -> SimResult:  # fmt: skip
    """Simulate ``job`` under the adaptive policy (see the module doc); ``record`` receives the
    switches."""
    changes = list(changes)
    roster = Roster(cluster, changes, recovery, step_s=job.step_s)
    devices = cluster.devices()
    first = policy.Metrics(
        num_workers=len(devices),
        straggler_ratio=policy.straggler_ratio({i: [1.0 / d.speed] for i, d in enumerate(devices)}),
    )
    rules = spec.policy.rules
    run = _Run(rules[policy.first_match(rules, first)].target, None, 0.0, 0, cluster, changes)
    parts: list[tuple[float, int, str, SimResult]] = []
    switches: list[Switch] = []
    events = 0
    while True:
        target = spec.targets[run.running]
        whole = run.simulate(target, job, job.steps - run.s0, recovery)
        events += whole.events
        seg = Segment(whole, run.t0, run.s0)
        found = None
        if len(switches) < spec.policy.coordinator.max_switches:
            found = next_switch(
                spec.policy, roster, seg, running=run.running, last=run.last, total_steps=job.steps,
                cluster=cluster,
            )  # fmt: skip
        if found is None:
            parts.append((run.t0, run.s0, target.kind, whole))
            break
        part = run.simulate(target, job, found.at_step - run.s0, recovery)
        events += part.events
        parts.append((run.t0, run.s0, target.kind, part))
        switches.append(_switch(spec, run, found, part, job, cluster, roster, recovery))
        sw = switches[-1]
        run.running, run.last, run.t0, run.s0 = found.target, found.announced, sw.start_s, sw.step
        run.cluster, run.changes = roster.segment(changes, switch_s=sw.at_s, start_s=sw.start_s)
    if record is not None:
        record.extend(switches)
    if not switches:
        only = parts[0][3]
        note = f"{parts[0][2]} throughout" + (f"; {only.note}" if only.note else "")
        return replace(only, strategy=spec.name, note=note)
    return _join(spec.name, parts, switches, cluster, changes, recovery, events)


def _switch(
    spec: AdaptiveSpec, run: _Run, found: Found, part: SimResult, job: SimJob, cluster: SimCluster,
    roster: Roster, recovery: Recovery,
) -> Switch:  # fmt: skip
    """The switch ``found`` once the segment's ``part`` up to its step is simulated."""
    came, went = spec.targets[run.running], spec.targets[found.target]
    at_s = run.t0 + part.time_s - _consensus_s(came, part, run.t0, job, cluster, roster)
    at_s = max(at_s, run.t0 + (part.timeline[-1][0] if part.timeline else 0.0))  # (never before its end)
    terms = switch_terms(came, went, job, cluster, roster.alive(at_s), recovery)
    d = found.decision
    return Switch(
        came=came.kind, went=went.kind, rule=d.rule, why=d.why, num_workers=found.metrics.num_workers,
        decided_s=found.decided_s, announced_step=found.announced, step=found.at_step, at_s=at_s,
        start_s=at_s + sum(terms.values()), terms=tuple(terms.items()),
    )  # fmt: skip


def _consensus_s(
    target: Target, part: SimResult, t0: float, job: SimJob, cluster: SimCluster, roster: Roster
) -> float:
    """The final consensus a simulated AD-PSGD run ends with (``sim/adpsgd.py``: one ring
    all-reduce of the model over the replicas), which a switch does not run; 0 for the others."""
    if not isinstance(target.sim, ADPSGDSpec):
        return 0.0
    replicas = roster.alive(t0 + (part.timeline[-1][0] if part.timeline else 0.0))
    if not replicas:
        return 0.0
    return ring_allreduce_s(len(replicas), job.model_bytes, cluster.link_among(replicas))


def _join(
    name: str, parts: list[tuple[float, int, str, SimResult]], switches: list[Switch], cluster: SimCluster,
    changes: list[Change], recovery: Recovery, events: int,
) -> SimResult:  # fmt: skip
    timeline: list[tuple[float, int, int]] = []
    recoveries: list[float] = []
    samples = 0
    for t0, s0, _, r in parts:
        timeline += [(t0 + t, s0 + s, n) for t, s, n in r.timeline]
        recoveries += r.recoveries_s
        samples += r.samples
    t0, s0, _, end = parts[-1]
    time_s = t0 + end.time_s
    held = Members(cluster, changes, recovery)  # (every device from its start to its revocation or the end)
    held.advance(time_s)
    held.close(time_s)
    lines = [
        f"{sw.came} -> {sw.went} at step {sw.step} (t={sw.at_s:.1f} s, {sw.num_workers} workers, "
        f"switch {sum(v for _, v in sw.terms) * 1e3:.1f} ms)"
        for sw in switches
    ]
    lines += [f"{kind}: {r.note}" for _, _, kind, r in parts if r.note]
    return SimResult(
        strategy=name, steps=s0 + end.steps, time_s=time_s, completed=end.completed,
        device_s=held.device_s, cost=held.cost, samples=samples, timeline=timeline,
        recoveries_s=recoveries, events=events, note="; ".join(lines),
    )  # fmt: skip
