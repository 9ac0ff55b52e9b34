"""Validator of pipeline schedules (pure): ``validate(schedule) -> list[Problem]``.

Checks, each reported as a ``Problem`` with a stable ``code``:

- ``bad_index``  a microbatch or peer index out of range, or a peer that is not the adjacent stage
  in the direction of the message (activations go i -> i+1, gradients i -> i-1);
- ``pass``       per stage, every microbatch has exactly one Forward and one Backward, forward first;
- ``dataflow``   a forward on stage i>0 runs only after receiving its input; a backward on a
  non-last stage only after receiving its gradient; a send only after the pass that produces it;
- ``unmatched``  every send has exactly one matching receive on the peer and vice versa;
- ``fifo``       on each directed link the receives come in the order of the sends (NCCL needs it);
- ``deadlock``   executing all stages with blocking receives (``timeline.dry_run``) gets stuck;
- ``version``    optimizer steps go v -> v+1 from version 0, passes name an existing version;
- ``stash``      each Backward names the version its Forward used (weight stashing);
- ``flush``      (GPipe, 1F1B) all passes of minibatch k use version k, and each stage runs exactly one
  optimizer step per minibatch, after all its backwards and before any forward of the next;
- ``update``     (PipeDream) exactly one optimizer step after every backward;
- ``newest``     (PipeDream without vertical sync) a forward uses the stage's newest version;
- ``vertical_sync`` (PipeDream with vertical sync) every stage uses, for minibatch b, stage 0's version.

``analyze(schedule)`` reports per stage the peak number of in-flight microbatches (forward done,
backward not yet) and the peak number of weight versions that must be held at once (a version lives
from the update that creates it until it is superseded or, if later, its last named use); both
counts come from ``flotilla.pipeline.stash_plan``, which the stage runtime uses too.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from flotilla.pipeline.schedule import (
    RECV_ACTIONS,
    SEND_ACTIONS,
    Backward,
    Forward,
    OptimizerStep,
    RecvAct,
    RecvGrad,
    Schedule,
    SendAct,
    SendGrad,
    format_action,
)
from flotilla.pipeline.stash_plan import peak_in_flight, peak_weight_versions
from flotilla.pipeline.timeline import (  # re-exported: the dry-run is part of the validator's API
    MessageKey,
    ScheduleError,
    Timeline,
    TimelineEntry,
    bubble_fraction,
    dry_run,
    makespan_s,
    message_key,
    modelled_timeline,
)

__all__ = [
    "Problem",
    "ScheduleStats",
    "ScheduleError",
    "Timeline",
    "TimelineEntry",
    "analyze",
    "bubble_fraction",
    "check",
    "dry_run",
    "makespan_s",
    "modelled_timeline",
    "validate",
]


@dataclass(frozen=True, slots=True)
class Problem:
    """One defect; ``action_idx`` is the position in the stage's list (-1 when not tied to one)."""

    code: str
    stage_idx: int
    action_idx: int
    message: str

    def __str__(self) -> str:
        return f"[{self.code}] stage {self.stage_idx} action {self.action_idx}: {self.message}"


@dataclass(frozen=True, slots=True)
class ScheduleStats:
    peak_in_flight: tuple[int, ...]
    peak_weight_versions: tuple[int, ...]


_EXPECTED_PEER = {SendAct: 1, RecvAct: -1, SendGrad: -1, RecvGrad: 1}


def validate(schedule: Schedule) -> list[Problem]:
    """All problems of ``schedule`` (empty list: the schedule is valid)."""
    problems = _check_indices(schedule)
    if problems:
        return problems  # later checks assume indices are in range
    for i in range(schedule.num_stages):
        problems += _check_passes(schedule, i)
        problems += _check_versions(schedule, i)
    problems += _check_matching(schedule)
    problems += _check_vertical_sync(schedule)
    if not any(p.code == "unmatched" for p in problems):
        try:
            dry_run(schedule)
        except ScheduleError as exc:
            problems.append(Problem("deadlock", -1, -1, str(exc)))
    return problems


def check(schedule: Schedule) -> Schedule:
    """Return ``schedule`` unchanged if valid, else raise ``ScheduleError`` listing the problems."""
    problems = validate(schedule)
    if problems:
        raise ScheduleError("invalid schedule:\n" + "\n".join(str(p) for p in problems))
    return schedule


def _check_indices(schedule: Schedule) -> list[Problem]:
    out = []
    total, p = schedule.total_microbatches, schedule.num_stages
    for i, stage in enumerate(schedule.stages):
        for idx, a in enumerate(stage):
            if isinstance(a, OptimizerStep):
                continue
            if not 0 <= a.microbatch_idx < total:
                out.append(
                    Problem("bad_index", i, idx, f"{format_action(a)}: microbatch outside 0..{total - 1}")
                )
            if isinstance(a, SEND_ACTIONS + RECV_ACTIONS) and (
                a.peer_stage != i + _EXPECTED_PEER[type(a)] or not 0 <= a.peer_stage < p
            ):
                want = i + _EXPECTED_PEER[type(a)]
                out.append(Problem("bad_index", i, idx, f"{format_action(a)}: peer must be stage {want}"))
    return out


def _check_passes(schedule: Schedule, i: int) -> list[Problem]:
    """Exactly one forward and backward per microbatch, forward first, data received before use."""
    out: list[Problem] = []
    last = schedule.num_stages - 1
    seen: dict[type, set[int]] = defaultdict(set)
    for idx, a in enumerate(schedule.stages[i]):
        if isinstance(a, OptimizerStep):
            continue
        b, done = a.microbatch_idx, seen[type(a)]
        needs = {
            Forward: RecvAct if i > 0 else None,
            Backward: RecvGrad if i < last else None,
            SendAct: Forward,
            SendGrad: Backward,
        }.get(type(a))
        if isinstance(a, (Forward, Backward)) and b in done:
            out.append(Problem("pass", i, idx, f"{format_action(a)}: microbatch {b} already had this pass"))
        if isinstance(a, Backward) and b not in seen[Forward]:
            out.append(Problem("pass", i, idx, f"{format_action(a)}: backward before the forward of {b}"))
        if needs is not None and b not in seen[needs]:
            out.append(
                Problem("dataflow", i, idx, f"{format_action(a)}: needs {needs.__name__} of {b} first")
            )
        done.add(b)
    for cls in (Forward, Backward):
        missing = sorted(set(range(schedule.total_microbatches)) - seen[cls])
        if missing:
            out.append(Problem("pass", i, -1, f"no {cls.__name__} for microbatch(es) {missing}"))
    return out


def _check_versions(schedule: Schedule, i: int) -> list[Problem]:
    """Version arithmetic (OPT v>v+1 from 0, passes name an existing version) and stashing."""
    out: list[Problem] = []
    newest, fwd_version = 0, {}
    for idx, a in enumerate(schedule.stages[i]):
        name = format_action(a)
        if isinstance(a, OptimizerStep):
            if (a.reads_version, a.writes_version) != (newest, newest + 1):
                out.append(Problem("version", i, idx, f"{name}: expected OPT{newest}>{newest + 1}"))
            newest = a.writes_version
        elif isinstance(a, (Forward, Backward)):
            b, v = a.microbatch_idx, a.weight_version
            if not 0 <= v <= newest:
                out.append(
                    Problem("version", i, idx, f"{name}: version {v} does not exist (newest {newest})")
                )
            if isinstance(a, Forward):
                fwd_version[b] = v
            elif b in fwd_version and v != fwd_version[b]:
                out.append(
                    Problem("stash", i, idx, f"{name}: the forward of {b} used version {fwd_version[b]}")
                )
    check_kind = _check_flush if schedule.kind.flushes else _check_async
    return out + check_kind(schedule, i)


def _check_flush(schedule: Schedule, i: int) -> list[Problem]:
    """GPipe/1F1B: minibatch k runs entirely between update k-1 and update k, with version k, and
    update k follows all m backwards of minibatch k."""
    out: list[Problem] = []
    newest, backwards_done = 0, 0
    for idx, a in enumerate(schedule.stages[i]):
        name = format_action(a)
        if isinstance(a, OptimizerStep):
            if backwards_done != schedule.num_microbatches:
                msg = (
                    f"{name}: after {backwards_done} of {schedule.num_microbatches} "
                    f"backwards of minibatch {newest}"
                )
                out.append(Problem("flush", i, idx, msg))
            newest, backwards_done = newest + 1, 0
        elif isinstance(a, (Forward, Backward)):
            k = schedule.minibatch_of(a.microbatch_idx)
            if k != newest or a.weight_version != k:
                msg = f"{name}: minibatch {k} must run with version {k} (stage holds version {newest})"
                out.append(Problem("flush", i, idx, msg))
            backwards_done += isinstance(a, Backward)
    if newest != schedule.num_minibatches:
        out.append(
            Problem("flush", i, -1, f"{newest} optimizer steps for {schedule.num_minibatches} minibatches")
        )
    return out


def _check_async(schedule: Schedule, i: int) -> list[Problem]:
    """PipeDream: one update right after every backward; forwards use the newest version unless
    vertical sync is on (then ``_check_vertical_sync`` applies)."""
    out: list[Problem] = []
    newest, owed = 0, 0
    for idx, a in enumerate(schedule.stages[i]):
        name = format_action(a)
        if isinstance(a, OptimizerStep):
            if owed != 1:
                out.append(Problem("update", i, idx, f"{name}: {owed} backward(s) since the last update"))
            newest, owed = newest + 1, 0
        elif isinstance(a, Backward):
            if owed:
                out.append(Problem("update", i, idx, f"{name}: the previous backward had no optimizer step"))
            owed += 1
        elif isinstance(a, Forward) and not schedule.vertical_sync and a.weight_version != newest:
            out.append(Problem("newest", i, idx, f"{name}: forward must use the newest version {newest}"))
    if owed:
        out.append(Problem("update", i, -1, "the last backward has no optimizer step"))
    return out


def _check_matching(schedule: Schedule) -> list[Problem]:
    """Every send has one receive on the peer and vice versa; each link delivers in FIFO order."""
    sends: dict[tuple[int, int], list[tuple[MessageKey, int, int]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[MessageKey, int, int]]] = defaultdict(list)
    for i, stage in enumerate(schedule.stages):
        for idx, a in enumerate(stage):
            if isinstance(a, SEND_ACTIONS + RECV_ACTIONS):
                key = message_key(i, a)
                table = sends if isinstance(a, SEND_ACTIONS) else recvs
                table[(key[2], key[3])].append((key, i, idx))
    out: list[Problem] = []
    for link in sorted(set(sends) | set(recvs)):
        sent = [k for k, _, _ in sends[link]]
        got = [k for k, _, _ in recvs[link]]
        for key, i, idx in sends[link]:
            if sent.count(key) != 1 or key not in got:
                msg = f"send {key} has {got.count(key)} receive(s) on stage {link[1]}"
                out.append(Problem("unmatched", i, idx, msg))
        for key, i, idx in recvs[link]:
            if got.count(key) != 1 or key not in sent:
                msg = f"receive {key} has {sent.count(key)} send(s) on stage {link[0]}"
                out.append(Problem("unmatched", i, idx, msg))
        common = set(sent) & set(got)
        if [k for k in sent if k in common] != [k for k in got if k in common]:
            out.append(Problem("fifo", link[1], -1, f"link {link[0]}->{link[1]}: receives not in send order"))
    return out


def _check_vertical_sync(schedule: Schedule) -> list[Problem]:
    if not schedule.vertical_sync:
        return []
    tag = {a.microbatch_idx: a.weight_version for a in schedule.stages[0] if isinstance(a, Forward)}
    out = []
    for i, stage in enumerate(schedule.stages[1:], start=1):
        for idx, a in enumerate(stage):
            if (
                isinstance(a, (Forward, Backward))
                and tag.get(a.microbatch_idx, a.weight_version) != a.weight_version
            ):
                msg = (
                    f"{format_action(a)}: stage 0 tagged {a.microbatch_idx} "
                    f"with version {tag[a.microbatch_idx]}"
                )
                out.append(Problem("vertical_sync", i, idx, msg))
    return out


def analyze(schedule: Schedule) -> ScheduleStats:
    """Peak in-flight microbatches and peak live weight versions per stage (static, order only)."""
    return ScheduleStats(
        peak_in_flight=tuple(peak_in_flight(stage) for stage in schedule.stages),
        peak_weight_versions=tuple(peak_weight_versions(stage) for stage in schedule.stages),
    )
