"""The verdict on a chaos run (pure): did training stay correct while workers were SIGKILLed,
frozen and restarted?  Input: the run's training records (``metrics.jsonl``; see
``roles/worker_records.py``: per committed unit ``step``, ``committed``, ``membership_epoch``,
``rank``, ``world_size``, ``samples``, ``pid``, ``digest``; ``discarded`` records), the job's
global-batch sampler and the pids the revocation schedule killed.  Output: one
:class:`ChaosVerdict` of five named :class:`Check` s, each of which can fail:

- ``steps_increase``: each process's committed steps strictly increase, and so do the steps in
  the order they were first committed across the job;
- ``every_step_once``: every step ``0 .. total_steps - 1`` is committed, each in ONE membership
  epoch (no gap, no step committed twice);
- ``identical_digests``: every commit of a step carries the same parameter digest (every commit
  that ``digest_every_steps`` says has one must have it);
- ``samples_once``: the committing records of a step hold distinct ranks of one view, each with
  exactly its shard's ``samples``; the union of the shards of every committed step uses each
  sample of a data epoch exactly once (a data epoch wholly inside the run uses all of them);
- ``no_hang``: no gap between the first commits of consecutive steps exceeds ``max_gap_s``.

What the records cannot show, and how it is explained (never silently):

- **A killed process's last records.**  Records travel with heartbeats, so a SIGKILLed worker
  loses those of its last fraction of a second.  A rank missing from a committed step is
  *explained* if the process that held that rank in that epoch was killed and has no record
  from that step on (``lost``), or if it recorded that step as discarded (``rolled forward``: the
  vote broke on it after the others had completed it; the next view hands it their state).
- **An orphan commit.**  A killed process may have committed a step that the survivors
  discarded and redid in the next view: its state died with it.  A commit is an orphan when its
  process was killed, committed nothing later, and the step was committed again in a later
  epoch.  Orphans are left out of every other check and counted.

Invariants: deterministic; no I/O, no clock, no torch (numpy through the sampler only).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flotilla.data.sampler import GlobalBatchSampler

__all__ = ["ChaosLimits", "ChaosVerdict", "Check", "check_chaos", "percentile"]

Record = Mapping[str, Any]
_SHOWN = 5  # problems named per failed check


@dataclass(frozen=True, kw_only=True, slots=True)
class Check:
    """One property: whether it held and what was found (figures, or the first problems)."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ChaosLimits:
    """What the run was: ``total_steps`` of the job, its ``sampler``, the parameter digest period
    (``report.digest_every_steps``; 0: none expected), the longest tolerated gap between two
    consecutive steps' first commits, and the pids the revocation schedule SIGKILLed."""

    total_steps: int
    sampler: GlobalBatchSampler
    max_gap_s: float
    digest_every_steps: int = 1
    killed_pids: frozenset[int] = field(default_factory=frozenset)


@dataclass(frozen=True, kw_only=True, slots=True)
class ChaosVerdict:
    checks: tuple[Check, ...]
    max_gap_s: float  # the longest gap between consecutive steps' first commits
    max_gap_step: int | None  # the step that came after it
    orphans: tuple[tuple[int, int], ...]  # (pid, step) of orphan commits (module doc)
    explained_shards: int  # ranks missing from a committed step, explained (module doc)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def report(self) -> str:
        """One line per check, then the figures."""
        lines = [f"{'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}" for c in self.checks]
        lines.append(f"orphan commits {len(self.orphans)}, explained missing shards {self.explained_shards}")
        return "\n".join(lines)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, linearly interpolated (numpy's default)."""
    if not values or not 0.0 <= q <= 1.0:
        raise ValueError(f"need values and 0 <= q <= 1 (got {len(values)} values, q={q})")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _problems(found: Sequence[str], total_note: str = "") -> str:
    shown = "; ".join(found[:_SHOWN])
    more = f" (+{len(found) - _SHOWN} more)" if len(found) > _SHOWN else ""
    return f"{len(found)} problem(s){total_note}: {shown}{more}"


def _training(records: Sequence[Record]) -> list[Record]:
    return [r for r in records if r.get("kind") != "eval" and "step" in r]


def _orphans(commits: Sequence[Record], killed: Collection[int]) -> set[int]:
    """Indices (into ``commits``) of orphan commits (module doc)."""
    last: dict[int, int] = {}
    epochs: dict[int, set[int]] = defaultdict(set)
    for r in commits:
        last[int(r["pid"])] = max(last.get(int(r["pid"]), -1), int(r["step"]))
        epochs[int(r["step"])].add(int(r["membership_epoch"]))
    return {
        i
        for i, r in enumerate(commits)
        if int(r["pid"]) in killed
        and int(r["step"]) == last[int(r["pid"])]
        and max(epochs[int(r["step"])]) > int(r["membership_epoch"])
    }


def _steps_increase(records: Sequence[Record], firsts: Mapping[int, float]) -> Check:
    bad: list[str] = []
    last: dict[int, int] = {}
    for r in records:
        if not r.get("committed"):
            continue
        pid, step = int(r["pid"]), int(r["step"])
        if pid in last and step <= last[pid]:
            bad.append(f"pid {pid} committed step {step} after step {last[pid]}")
        last[pid] = step
    ordered = sorted(firsts)
    for a, b in zip(ordered, ordered[1:]):
        if firsts[b] <= firsts[a]:
            bad.append(
                f"step {b} was first committed at {firsts[b]:.3f} s, before step {a} ({firsts[a]:.3f} s)"
            )
    if bad:
        return Check(name="steps_increase", ok=False, detail=_problems(bad))
    return Check(
        name="steps_increase", ok=True, detail=f"{len(last)} processes, {len(firsts)} steps in order"
    )


def _every_step_once(by_step: Mapping[int, Sequence[Record]], total_steps: int) -> Check:
    missing = [s for s in range(total_steps) if s not in by_step]
    extra = sorted(s for s in by_step if not 0 <= s < total_steps)
    twice = {
        s: sorted({int(r["membership_epoch"]) for r in rs})
        for s, rs in by_step.items()
        if len({int(r["membership_epoch"]) for r in rs}) > 1
    }
    bad = [f"step {s} never committed" for s in missing]
    bad += [f"step {s} beyond the job's {total_steps} steps" for s in extra]
    bad += [f"step {s} committed in epochs {e}" for s, e in sorted(twice.items())]
    if bad:
        return Check(name="every_step_once", ok=False, detail=_problems(bad))
    return Check(name="every_step_once", ok=True, detail=f"steps 0..{total_steps - 1} each committed once")


def _identical_digests(by_step: Mapping[int, Sequence[Record]], every: int) -> Check:
    bad: list[str] = []
    compared = 0
    for s, rs in sorted(by_step.items()):
        expected = every > 0 and (s + 1) % every == 0
        digests = {str(r["digest"]) for r in rs if "digest" in r}
        lacking = [int(r["pid"]) for r in rs if "digest" not in r]
        if expected and lacking:
            bad.append(f"step {s}: no digest from pids {lacking}")
        if len(digests) > 1:
            bad.append(f"step {s}: {len(digests)} different digests over {len(rs)} replicas")
        compared += len(rs) if digests else 0
    if bad:
        return Check(name="identical_digests", ok=False, detail=_problems(bad))
    return Check(
        name="identical_digests", ok=True, detail=f"{compared} digests over {len(by_step)} steps agree"
    )


@dataclass(slots=True)
class _Holders:
    """Who held which rank in which epoch, and what each process recorded (for explanations)."""

    rank_pid: dict[tuple[int, int], set[int]] = field(default_factory=lambda: defaultdict(set))
    pid_epochs: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))
    pid_last_step: dict[int, int] = field(default_factory=dict)
    discarded: set[tuple[int, int, int]] = field(default_factory=set)  # (pid, epoch, step)

    @classmethod
    def of(cls, records: Sequence[Record]) -> _Holders:
        h = cls()
        for r in records:
            pid, epoch, step = int(r["pid"]), int(r["membership_epoch"]), int(r["step"])
            h.pid_epochs[pid].add(epoch)
            h.pid_last_step[pid] = max(h.pid_last_step.get(pid, -1), step)
            if r.get("rank") is not None:
                h.rank_pid[(epoch, int(r["rank"]))].add(pid)
            if not r.get("committed") and r.get("discarded") is not None:
                h.discarded.add((pid, epoch, step))
        return h

    def explains(self, epoch: int, rank: int, step: int, killed: Collection[int]) -> bool:
        """Whether rank ``rank``'s missing record of committed ``step`` is explained (module doc)."""
        holders = self.rank_pid.get((epoch, rank), set())
        for pid in holders:
            if (pid, epoch, step) in self.discarded:
                return True  # rolled forward
            if pid in killed and self.pid_last_step.get(pid, -1) < step:
                return True  # lost with the killed process
        if holders:
            return False
        # nobody's record shows the rank: a killed process that never recorded in this epoch
        return any(max(self.pid_epochs.get(pid, {-1})) < epoch for pid in killed)


def _samples_once(
    by_step: Mapping[int, Sequence[Record]], records: Sequence[Record], lim: ChaosLimits
) -> tuple[Check, int]:
    sampler, holders = lim.sampler, _Holders.of(records)
    bad: list[str] = []
    explained = 0
    used: dict[int, list[Any]] = defaultdict(list)  # data epoch -> index arrays
    for s, rs in sorted(by_step.items()):
        worlds = {int(r["world_size"]) for r in rs}
        ranks = [int(r["rank"]) for r in rs]
        if len(worlds) != 1 or len(set(ranks)) != len(ranks) or not all(0 <= k < min(worlds) for k in ranks):
            bad.append(f"step {s}: ranks {sorted(ranks)} in world sizes {sorted(worlds)}")
            continue
        world, epoch = worlds.pop(), int(rs[0]["membership_epoch"])
        for r in rs:
            want = len(sampler.shard(s, int(r["rank"]), world))
            if int(r["samples"]) != want:
                bad.append(f"step {s} rank {r['rank']}: {r['samples']} samples, its shard has {want}")
        for rank in sorted(set(range(world)) - set(ranks)):
            if holders.explains(epoch, rank, s, lim.killed_pids):
                explained += 1
            else:
                bad.append(
                    f"step {s}: rank {rank} of {world} (epoch {epoch}) has no record and no explanation"
                )
        used[sampler.data_epoch(s)] += [sampler.shard(s, k, world) for k in range(world)]
    complete = lim.total_steps // sampler.steps_per_epoch
    for data_epoch, parts in sorted(used.items()):
        flat = [int(i) for part in parts for i in part]
        seen = set(flat)
        if len(seen) != len(flat):
            bad.append(f"data epoch {data_epoch}: {len(flat) - len(seen)} samples used twice")
        want = min(sampler.steps_per_epoch * sampler.global_batch_size, sampler.num_samples)
        if data_epoch < complete and len(seen) != want:
            bad.append(f"data epoch {data_epoch}: {len(seen)} distinct samples used of {want}")
    if bad:
        return Check(name="samples_once", ok=False, detail=_problems(bad)), explained
    detail = f"{len(used)} data epoch(s) ({complete} complete), every sample used once"
    return Check(name="samples_once", ok=True, detail=detail), explained


def _no_hang(firsts: Mapping[int, float], max_gap_s: float) -> tuple[Check, float, int | None]:
    ordered = sorted(firsts)
    gaps = [(firsts[b] - firsts[a], b) for a, b in zip(ordered, ordered[1:])]
    worst, step = max(gaps, default=(0.0, None))
    detail = f"largest gap {worst:.3f} s (before step {step}), limit {max_gap_s:.3f} s"
    return Check(name="no_hang", ok=worst <= max_gap_s, detail=detail), worst, step


def check_chaos(records: Sequence[Record], lim: ChaosLimits) -> ChaosVerdict:
    """The verdict on a chaos run's ``records`` (any order per process as written; evaluation
    records are ignored)."""
    training = _training(records)
    commits = [r for r in training if r.get("committed")]
    orphan_ix = _orphans(commits, lim.killed_pids)
    kept = [r for i, r in enumerate(commits) if i not in orphan_ix]
    by_step: dict[int, list[Record]] = defaultdict(list)
    for r in kept:
        by_step[int(r["step"])].append(r)
    firsts = {s: min(float(r["time_s"]) for r in rs) for s, rs in by_step.items()}
    samples, explained = _samples_once(by_step, training, lim)
    hang, worst, worst_step = _no_hang(firsts, lim.max_gap_s)
    checks = (
        _steps_increase(training, firsts),
        _every_step_once(by_step, lim.total_steps),
        _identical_digests(by_step, lim.digest_every_steps),
        samples,
        hang,
    )
    orphans = tuple(sorted((int(commits[i]["pid"]), int(commits[i]["step"])) for i in orphan_ix))
    return ChaosVerdict(
        checks=checks,
        max_gap_s=worst,
        max_gap_step=worst_step,
        orphans=orphans,
        explained_shards=explained,
    )
