"""Partial Reduce group generation (SPEC §5), pure: which ready workers form the next group, with
which averaging weights, and whether a group's reduction is committed.  No I/O, no threads, no
wall clock (``now`` is passed in); the coordinator's runtime (``sync/pr_service.py``) and the
simulator call the same code.

The controller keeps a FIFO queue of *ready* workers (each with its model ``version``: the number
of updates its model holds).  Let P' = min(P, live workers):

- as soon as P' workers are ready they form a group (the oldest P' in the queue);
- if fewer than P' are ready but at least 2, and the oldest has waited ``group_timeout_s``, all the
  ready ones form a smaller group;
- a single live worker gets a *solo* assignment (nothing to average with) -- unless the others
  *finished* their steps (:meth:`GroupController.finish`): then it is **done** (``done_for``).
  Solo steps are for a survivor of deaths; a straggler whose partners finished would otherwise
  end the job with a tail of unaveraged local steps (measured: 56 solo steps took the final model
  of a 3x-slower worker from 0.964 to 0.839 test accuracy), so it stops with its last average.

**No update isolation.**  Per *mixing round* the controller tracks, for every live worker i, the
set ``knows[i]`` of workers whose round-start models have reached i's model through committed
groups (a group sets every member's set to the union of the members' sets; time-respecting, unlike
a union-find over the round's groups).  A round ends, and every set is reset to ``{i}``, when every
live worker knows every live worker.  After ``bridge_after`` committed groups in a round the
controller forms only *bridging* groups: groups whose members do not all know the same set (it
waits for such a group rather than form a useless one).  A bridging group raises
Φ = Σ_i |knows[i]| by at least 1 (a member's set cannot change while it is in an open group), and
Φ ≤ N², so a round lasts at most ``bridge_after + N(N-1)`` committed groups: :func:`round_bound`.
An update made by worker j during round r is in j's model when round r + 1 starts, hence it
reaches every live worker within two rounds, i.e. within ``2 * round_bound`` committed groups.
Deadlock-free: if every live worker is ready and no bridging group exists, all sets are equal,
hence all complete, and the round has ended.  (The sets, rounds and bridging choice are kept by
``sync/pr_mixing.py``.)

**Atomic reduction.**  Members report the outcome of their group all-reduce (``report``).  The
group is *committed* once every member reported success, *aborted* as soon as one reported a
failure or was dropped (dead, stalled, left) before it reported: survivors then apply all of it or
none of it.  An aborted member set gets a new namespace generation (its process group is rebuilt).

**Weights.**  CPR: 1/P for each member; DPR: :func:`dpr_weights` (α^δ normalised, δ = versions
behind the freshest member).  After a committed group every member's version is the group's
maximum (the freshest model's count of updates).

**Newcomers.**  A worker that joins the running job (:meth:`GroupController.admit`) holds no
model yet: it is live and ready, but every group it is in also holds at least one *holder* (a
worker with a model), and it weighs 0 there -- the group's result is the holders' average, which
the newcomer takes (a fill, not a step: it contributes nothing it does not have).  Once a group
with it commits, it is a holder.  A newcomer never gets a solo step; when no holder is live any
more, the model is lost for it (:meth:`GroupController.lost_for`).  A worker with a model that
was not a member (it joined while another strategy ran, or left for one and came back: an
adaptive switch) is admitted as a holder.  Who may be admitted at all (the coordinator's live
workers, never a dead one) is the caller's decision.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import islice

from flotilla.sync.pr_mixing import MixingRounds

__all__ = [
    "Assignment",
    "ControllerConfig",
    "ControllerError",
    "GroupController",
    "GroupState",
    "dpr_weights",
    "round_bound",
]


class ControllerError(ValueError):
    """A message the controller must refuse (unknown worker, replayed or forged group report)."""


def dpr_weights(versions: Sequence[int], alpha: float) -> tuple[float, ...]:
    """Dynamic partial reduce weights: member i, δ_i = max(versions) - versions[i] versions behind
    the freshest, gets α^δ_i, normalised to sum 1 (α = 1: 1/P each, constant partial reduce)."""
    if not versions:
        raise ValueError("dpr_weights: at least one member")
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"dpr_weights: alpha must be in (0, 1], got {alpha!r}")
    top = max(versions)
    raw = [alpha ** (top - v) for v in versions]
    total = sum(raw)
    return tuple(r / total for r in raw)


def round_bound(num_workers: int, bridge_after: int) -> int:
    """The most committed groups one mixing round can last (see the module doc)."""
    return bridge_after + num_workers * (num_workers - 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class ControllerConfig:
    group_size: int  # P
    group_timeout_s: float = 0.5
    alpha: float = 1.0  # 1.0: CPR
    bridge_after: int = 0  # committed groups per round before bridging is forced; 0: 2 * num workers

    def __post_init__(self) -> None:
        if type(self.group_size) is not int or self.group_size < 2:
            raise ValueError(f"ControllerConfig.group_size must be an int >= 2, got {self.group_size!r}")
        if not self.group_timeout_s >= 0.0:
            raise ValueError(f"ControllerConfig.group_timeout_s must be >= 0, got {self.group_timeout_s!r}")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"ControllerConfig.alpha must be in (0, 1], got {self.alpha!r}")
        if type(self.bridge_after) is not int or self.bridge_after < 0:
            raise ValueError(f"ControllerConfig.bridge_after must be an int >= 0, got {self.bridge_after!r}")


class GroupState(Enum):
    OPEN = "open"
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass(frozen=True, kw_only=True, slots=True)
class Assignment:
    """A group (or, ``group_id`` -1 and one member, a solo step) for its members."""

    group_id: int
    members: tuple[int, ...]
    versions: tuple[int, ...]
    weights: tuple[float, ...]
    namespace: str
    bridging: bool = False

    @property
    def solo(self) -> bool:
        return self.group_id < 0


@dataclass(slots=True)
class _Group:
    assignment: Assignment
    ok: set[int] = field(default_factory=set)
    state: GroupState = GroupState.OPEN


_HISTORY = 4096  # decided groups kept for late reports and polls


class GroupController:
    """The controller's state (see the module doc).  Not thread-safe: one caller at a time."""

    def __init__(self, config: ControllerConfig, workers: Iterable[int]) -> None:
        self.config = config
        self.live: set[int] = set(workers)
        if len(self.live) < 1:
            raise ValueError("GroupController: at least one worker")
        self._n0 = len(self.live)
        self.bridge_after = config.bridge_after or 2 * self._n0
        self._queue: dict[int, tuple[int, float]] = {}  # worker -> (version, ready since), FIFO
        self._pending: dict[int, Assignment] = {}  # worker -> its latest assignment
        self._groups: dict[int, _Group] = {}
        self._next_id = 0
        self._gen: dict[tuple[int, ...], int] = {}
        self.mixing = MixingRounds(self.live)  # (who knows whom this round: the bridging rule)
        self.versions: dict[int, int] = {w: 0 for w in self.live}
        self.finished: set[int] = set()  # left after their last step (not dead)
        self.newcomers: set[int] = set()  # admitted mid-run, no model yet (module doc)
        self.committed = self.aborted = self.member_total = 0

    # ------------------------------------------------------------------ inputs
    def admit(self, worker_id: int, *, holder: bool = False) -> None:
        """``worker_id`` becomes a live member: a newcomer until a group fills it, or (``holder``)
        a worker that has a model of its own."""
        if type(worker_id) is not int or worker_id < 0:
            raise ControllerError(f"admit: worker id must be an int >= 0, got {worker_id!r}")
        if worker_id in self.live:
            raise ControllerError(f"worker {worker_id} is already a member of this partial reduce")
        self.live.add(worker_id)
        self.mixing.added(worker_id)
        self.finished.discard(worker_id)
        if not holder:
            self.newcomers.add(worker_id)
        self.versions.setdefault(worker_id, 0)

    def ready(self, worker_id: int, version: int, now: float) -> None:
        """``worker_id`` finished a local step (its model holds ``version`` updates) and waits."""
        if worker_id not in self.live:
            raise ControllerError(f"worker {worker_id} is not a live member of this partial reduce")
        if worker_id in self._queue or self._open_group_of(worker_id) is not None:
            raise ControllerError(f"worker {worker_id} is already ready or in an open group")
        if type(version) is not int or version < 0:
            raise ControllerError(f"worker {worker_id}: version must be an int >= 0, got {version!r}")
        self._pending.pop(worker_id, None)
        self.versions[worker_id] = version
        self._queue[worker_id] = (version, now)

    def withdraw(self, worker_id: int) -> None:
        """``worker_id`` leaves the ready queue (the job stops); it stays live."""
        self._queue.pop(worker_id, None)

    def report(self, worker_id: int, group_id: int, ok: bool) -> GroupState:
        """A member's outcome of group ``group_id``'s reduction; returns the group's state."""
        g = self._groups.get(group_id)
        if g is None or worker_id not in g.assignment.members:
            raise ControllerError(f"worker {worker_id} reports on group {group_id}, which is not its own")
        if g.state is GroupState.OPEN:
            if not ok:
                self._decide(g, GroupState.ABORTED)
            else:
                g.ok.add(worker_id)
                if g.ok >= set(g.assignment.members):
                    self._decide(g, GroupState.COMMITTED)
        return g.state

    def drop(self, worker_id: int) -> list[int]:
        """``worker_id`` is dead, stalled or has left: out of the queue and the live set; the open
        groups it had not reported success in are aborted (their ids are returned)."""
        # (a worker is in at most one open group, its latest assignment: ``ready`` refuses a worker
        # still in an open group, and only the ready queue is assigned)
        g = self._open_group_of(worker_id)
        self.live.discard(worker_id)
        self.mixing.removed(worker_id)  # (its last version stays in ``versions``: the lag report)
        self.newcomers.discard(worker_id)
        self._queue.pop(worker_id, None)
        self._pending.pop(worker_id, None)
        aborted = []
        if g is not None and worker_id not in g.ok:
            self._decide(g, GroupState.ABORTED)
            aborted.append(g.assignment.group_id)
        self.mixing.end_round_if_mixed()
        return aborted

    def finish(self, worker_id: int) -> list[int]:
        """``worker_id`` did its last step and left: dropped like a dead worker (:meth:`drop`), and
        remembered as finished (``done_for``)."""
        if worker_id in self.live:
            self.finished.add(worker_id)
        return self.drop(worker_id)

    # ------------------------------------------------------------------ outputs
    def done_for(self, worker_id: int) -> bool:
        """Whether ``worker_id`` should stop: it is the last live worker and the others finished
        (at least one of them did: a survivor of deaths alone trains on, solo)."""
        return self.live == {worker_id} and bool(self.finished)

    def lost_for(self, worker_id: int) -> bool:
        """Whether newcomer ``worker_id`` can never be filled: no live worker holds a model."""
        return worker_id in self.newcomers and not (self.live - self.newcomers)

    def state_of(self, group_id: int) -> GroupState | None:
        g = self._groups.get(group_id)
        return None if g is None else g.state

    def assignment_for(self, worker_id: int) -> Assignment | None:
        return self._pending.get(worker_id)

    def form(self, now: float) -> list[Assignment]:
        """Form every group that is due at ``now`` (see the module doc)."""
        out: list[Assignment] = []
        order = sorted(self._queue, key=lambda w: (self._queue[w][1], w))  # (oldest first; once)
        while True:
            a = self._form_one(now, order)
            if a is None:
                return out
            out.append(a)
            order = [w for w in order if w in self._queue]

    @property
    def mean_group_size(self) -> float:
        return self.member_total / self.committed if self.committed else 0.0

    def version_lag(self) -> dict[int, int]:
        """Per worker (live or gone): versions behind the freshest, as of their last ready or group."""
        top = max(self.versions.values(), default=0)
        return {w: top - v for w, v in sorted(self.versions.items())}

    @property
    def forcing(self) -> bool:
        return self.mixing.round_groups >= self.bridge_after

    @property
    def rounds_completed(self) -> int:
        return self.mixing.rounds_completed

    @property
    def knows(self) -> dict[int, frozenset[int]]:
        return self.mixing.knows

    # ------------------------------------------------------------------ internals
    def _open_group_of(self, worker_id: int) -> _Group | None:
        a = self._pending.get(worker_id)
        g = None if a is None else self._groups.get(a.group_id)
        return g if g is not None and g.state is GroupState.OPEN else None

    def _form_one(self, now: float, order: list[int]) -> Assignment | None:
        """One group from the ready queue, ``order`` (oldest first), if one is due."""
        if not order:
            return None
        target = min(self.config.group_size, len(self.live))
        if target < 2:  # one live worker: a solo step (not for a newcomer: it has nothing)
            return None if order[0] in self.newcomers else self._assign(order[:1], bridging=False)
        timed_out = now - self._queue[order[0]][1] >= self.config.group_timeout_s
        size = target if len(order) >= target else (len(order) if timed_out and len(order) >= 2 else 0)
        if size == 0:
            return None
        chosen = self._bridging(order, size) if self.forcing else order[:size]
        chosen = None if chosen is None else self._with_holder(chosen, order)
        return None if chosen is None else self._assign(chosen, bridging=self.forcing)

    def _with_holder(self, chosen: list[int], order: list[int]) -> list[int] | None:
        """``chosen``, its last member swapped for the oldest ready holder if it holds none (a
        group of newcomers only would average nothing); None when no holder is ready."""
        if any(w not in self.newcomers for w in chosen):
            return chosen
        holder = next((w for w in order if w not in self.newcomers), None)
        return None if holder is None else [*chosen[:-1], holder]

    def _bridging(self, order: list[int], size: int) -> list[int] | None:
        """``size`` ready workers (oldest first) whose knowledge sets are not all equal, or None."""
        return self.mixing.bridging(order, size)

    def _assign(self, members: list[int], *, bridging: bool) -> Assignment:
        members_t = tuple(sorted(members))
        versions = tuple(self._queue.pop(w)[0] for w in members_t)
        if len(members_t) == 1:
            a = Assignment(group_id=-1, members=members_t, versions=versions, weights=(1.0,), namespace="")
        else:
            gen = self._gen.get(members_t, 0)
            held = iter(
                dpr_weights(
                    [v for w, v in zip(members_t, versions) if w not in self.newcomers], self.config.alpha
                )
            )
            a = Assignment(
                group_id=self._next_id,
                members=members_t,
                versions=versions,
                weights=tuple(0.0 if w in self.newcomers else next(held) for w in members_t),
                namespace=f"pr/{'-'.join(map(str, members_t))}/{gen}",
                bridging=bridging,
            )
            self._groups[self._next_id] = _Group(assignment=a)
            self._next_id += 1
            self._trim()
        for w in members_t:
            self._pending[w] = a
        return a

    def _decide(self, g: _Group, state: GroupState) -> None:
        g.state = state
        a = g.assignment
        if state is GroupState.ABORTED:
            self.aborted += 1
            self._gen[a.members] = self._gen.get(a.members, 0) + 1
            return
        self.committed += 1
        self.member_total += len(a.members)
        top = max(v for w, v in zip(a.members, a.versions) if w not in self.newcomers)  # (holders')
        live = [w for w in a.members if w in self.live]
        for w in live:
            self.versions[w] = top
        self.mixing.merged(live)
        self.newcomers -= set(a.members)  # (filled: holders now)
        self.mixing.end_round_if_mixed()

    def _trim(self) -> None:
        if len(self._groups) > _HISTORY:  # (ids grow: the dict's first entries are the oldest)
            for gid in list(islice(self._groups, len(self._groups) - _HISTORY)):
                if self._groups[gid].state is not GroupState.OPEN:
                    del self._groups[gid]
