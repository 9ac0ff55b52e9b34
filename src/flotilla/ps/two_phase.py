"""A clock is applied on every shard or on none (issue 19): the two-phase push rules, pure.
No torch, no I/O, no wall clock; the shard (``ps/store.py``) and the worker (``ps/client.py``)
execute them, ``tests/unit/test_ps_two_phase.py`` checks them over random interleavings.

Protocol (a job with more than one shard; with one shard a push is atomic by itself):

1. **stage**: the worker sends its update of clock ``c`` to every shard (``ps.stage``).  A shard
   validates it like a push and keeps it aside: not applied, not visible to reads, not counted
   by the gate.  At most one staged clock per worker, and only ``c = recorded`` (the worker's
   committed clock).
2. **commit**: once *every* shard acknowledged the stage, the worker commits ``c`` on every shard
   (``ps.commit``, or ``ps.cpull``: the commit carried by its pull of the next clock, on the same
   connection, so the synchronous path costs no extra round trip beyond the stage).  Commit
   applies the staged update exactly like a push.
3. **eviction resolves** a dead worker's staged clock on every shard the same way: the evicting
   party first **fences** the worker on every shard (no stage or commit from it is accepted any
   more, so what it reads next is final) and collects each shard's committed clock, then tells
   every shard to **resolve** up to ``target = max(committed clocks)``
   (:func:`resolution_target`): a shard at ``target - 1`` whose staged clock is ``target - 1``
   commits it, every other staged clock is discarded, and the worker leaves the table.

Why it is safe: a commit of ``c`` is sent only after every shard staged ``c``, and a shard drops
a staged clock only by committing it or by a resolve.  So if any shard committed ``c``, every
other shard has ``c`` committed or still staged, and ``target = c + 1`` commits it there; if
none did, ``target = c`` and every shard discards it.  Either way every shard ends with the same
clock for the dead worker: never half-applied.  (A staged update is not in the snapshots: a shard
that restarts while holding one loses it, and the live worker stages it again on ``not_staged``;
the guarantee assumes that no shard restarts between a dead worker's stage and its resolution.)

Retries are idempotent: staging a clock already committed answers ``done``; staging the staged
clock again replaces it (``restage``); committing a committed clock answers ``done``.

**Parts** (a HetPipe virtual worker, SPEC §2: k pipeline stages, each holding a partition of the
keys, push one update per wave under the VW's one worker id and clock): a clock may be staged
part by part (``ps.stage_part``, :func:`stage_part`); a plain ``ps.stage`` is part 0 of 1.  The
parts of one clock name the same count ``parts`` (``1 <= parts <=`` :data:`MAX_PARTS`), each
``0 <= part < parts``, and hold disjoint chunks (a part may hold none on a shard: it still counts
as staged there); anything else is refused and changes nothing.  Re-staging a part replaces it.
A VW's stages need not agree among themselves when to commit: each stage, once its part is
staged on every shard, sends its **vote** (:func:`vote_verdict`, ``ps.vpull``) to every shard; a
shard applies the clock when every part has voted there -- each vote says that part is staged on
every shard, so the clock is then complete everywhere and the commit is safe as above.
The clock counts as *staged* (:attr:`Parts.staged`, what :func:`commit_verdict`,
:func:`resolve_verdict` and the fence's report see) only once every part is staged; the commit
then applies the union of the parts as one push.  An incomplete clock is ``not_staged`` for a
commit and discarded by a resolution.  The safety argument above holds unchanged provided the
VW's stages send the commit only once every part is staged on every shard.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from flotilla.ps.clock_rules import Refused

__all__ = [
    "MAX_PARTS",
    "NONE",
    "Parts",
    "commit_verdict",
    "resolution_target",
    "resolve_verdict",
    "stage_part",
    "stage_verdict",
    "vote_verdict",
]

NONE = -1  # "no staged clock"
MAX_PARTS = 64  # parts one clock may be staged in (the stages of a virtual worker)


@dataclass(frozen=True, slots=True)
class Parts:
    """The parts of one worker's clock staged on a shard: ``chunks[part]`` = that part's chunk
    ids (any ids that name a shard's chunks one to one, e.g. its slots).  Never mutated."""

    clock: int
    count: int  # the parts the clock is staged in
    chunks: Mapping[int, frozenset[int]]
    votes: frozenset[int] = frozenset()  # parts that said "staged on every shard" (vote_verdict)

    @property
    def complete(self) -> bool:
        return len(self.chunks) == self.count

    @property
    def staged(self) -> int:
        """The staged clock as the other rules see it: :data:`NONE` until every part is staged."""
        return self.clock if self.complete else NONE


def _check_fence(worker_id: int, fenced: bool) -> None:
    if fenced:
        raise Refused("unknown_worker", f"worker {worker_id} was declared dead: its pushes are refused")


def stage_verdict(
    worker_id: int, recorded: int, staged: int, clock: object, *, fenced: bool
) -> Literal["stage", "restage", "done"]:
    """What a shard does with ``worker_id``'s stage of ``clock`` (``recorded``: its committed
    clock, ``staged``: its staged clock or :data:`NONE`)."""
    _check_fence(worker_id, fenced)
    if type(clock) is not int:
        raise Refused("bad_clock", f"stage clock must be an int, got {clock!r}")
    if clock == recorded - 1:
        return "done"  # a retry of a clock already committed here
    if clock != recorded:
        raise Refused("bad_clock", f"worker {worker_id} stages clock {clock}, its clock here is {recorded}")
    return "restage" if staged == clock else "stage"


def stage_part(
    worker_id: int,
    recorded: int,
    current: Parts | None,
    clock: object,
    part: object,
    parts: object,
    chunks: Collection[int],
    *,
    fenced: bool,
) -> tuple[Literal["stage", "restage", "done"], Parts | None]:
    """What a shard does with ``worker_id``'s stage of ``part`` of ``parts`` of ``clock`` holding
    ``chunks`` (``current``: what it holds staged for the worker, or None), and the parts it then
    holds (None for ``done``: nothing changes).  ``Refused``: ``bad_part`` (a part or count out of
    range, or a count other than the staged parts'), ``bad_key`` (chunks shared with another
    part, or repeated), or :func:`stage_verdict`'s codes."""
    _check_fence(worker_id, fenced)
    if type(parts) is not int or not 1 <= parts <= MAX_PARTS:
        raise Refused("bad_part", f"parts must be an int in [1, {MAX_PARTS}], got {parts!r}")
    if type(part) is not int or not 0 <= part < parts:
        raise Refused("bad_part", f"part must be an int in [0, {parts - 1}] (parts={parts}), got {part!r}")
    if stage_verdict(worker_id, recorded, NONE, clock, fenced=fenced) == "done":
        return "done", None
    assert type(clock) is int  # (checked by stage_verdict)
    held = frozenset(chunks)
    if len(held) != len(chunks):
        raise Refused("bad_key", f"part {part} names a chunk twice")
    others: Mapping[int, frozenset[int]] = {}
    if current is not None and current.clock == clock:  # (a staged clock is always the recorded one)
        if current.count != parts:
            raise Refused(
                "bad_part",
                f"worker {worker_id}'s clock {clock} is staged in {current.count} parts, "
                f"this part says {parts}",
            )
        others = {p: c for p, c in current.chunks.items() if p != part}
        if any(held & c for c in others.values()):
            raise Refused(
                "bad_key", f"part {part} of worker {worker_id}'s clock {clock} repeats chunks of another part"
            )
    same = current if current is not None and current.clock == clock else None
    verdict: Literal["stage", "restage"] = "restage" if same is not None and part in same.chunks else "stage"
    votes = same.votes if same is not None else frozenset()
    return verdict, Parts(clock, parts, {**others, part: held}, votes)


def vote_verdict(
    worker_id: int,
    recorded: int,
    current: Parts | None,
    clock: object,
    part: object,
    parts: object,
    *,
    fenced: bool,
) -> tuple[Literal["apply", "wait", "done"], Parts | None]:
    """``part``'s vote to commit ``worker_id``'s ``clock``: the part says it is staged on every
    shard.  ``apply``: this vote completes the votes (every part voted, so every part is staged
    on every shard: the commit is safe) -- apply the clock; ``wait``: recorded (the parts then
    held returned); ``done``: committed already (nothing changes).  ``not_staged`` when this
    shard does not hold the voting part (it restarted: the part stages again), ``bad_part`` and
    :func:`commit_verdict`'s codes otherwise."""
    _check_fence(worker_id, fenced)
    if type(parts) is not int or not 1 <= parts <= MAX_PARTS:
        raise Refused("bad_part", f"parts must be an int in [1, {MAX_PARTS}], got {parts!r}")
    if type(part) is not int or not 0 <= part < parts:
        raise Refused("bad_part", f"part must be an int in [0, {parts - 1}] (parts={parts}), got {part!r}")
    if type(clock) is not int:
        raise Refused("bad_clock", f"commit clock must be an int, got {clock!r}")
    if clock == recorded - 1:
        return "done", None
    if clock != recorded:
        raise Refused("bad_clock", f"worker {worker_id} commits clock {clock}, its clock here is {recorded}")
    if current is None or current.clock != clock or part not in current.chunks:
        raise Refused("not_staged", f"part {part} of worker {worker_id}'s clock {clock} is not staged here")
    if current.count != parts:
        raise Refused(
            "bad_part",
            f"worker {worker_id}'s clock {clock} is staged in {current.count} parts, the vote says {parts}",
        )
    now = Parts(current.clock, current.count, current.chunks, current.votes | {part})
    return ("apply" if len(now.votes) == now.count else "wait"), now


def commit_verdict(
    worker_id: int, recorded: int, staged: int, clock: object, *, fenced: bool
) -> Literal["apply", "done"]:
    """What a shard does with ``worker_id``'s commit of ``clock``: apply the staged update, or
    nothing (``done``: committed already).  ``not_staged`` (e.g. the shard restarted and lost
    it: the worker stages it again) and ``bad_clock`` are refusals."""
    _check_fence(worker_id, fenced)
    if type(clock) is not int:
        raise Refused("bad_clock", f"commit clock must be an int, got {clock!r}")
    if clock == recorded - 1:
        return "done"
    if clock != recorded:
        raise Refused("bad_clock", f"worker {worker_id} commits clock {clock}, its clock here is {recorded}")
    if staged != clock:
        raise Refused("not_staged", f"worker {worker_id}'s clock {clock} is not staged on this shard")
    return "apply"


def resolution_target(committed: Iterable[int]) -> int:
    """The clock every shard must end at for a fenced worker: the highest committed clock any
    shard reports (see the module doc)."""
    clocks = list(committed)
    if not clocks:
        raise ValueError("resolution_target needs at least one shard's committed clock")
    return max(clocks)


def resolve_verdict(recorded: int, staged: int, target: int) -> Literal["commit", "discard"]:
    """What a shard does with a fenced worker's staged clock when told to resolve up to
    ``target``: ``commit`` it (the shard is one clock short and holds exactly that clock) or
    ``discard`` it (or nothing staged).  A shard more than one clock short, or one clock short
    without the staged clock, would break the invariant: ``Refused("half_applied")`` (the shard
    logs it; it cannot happen while the protocol above is followed)."""
    if target <= recorded:
        return "discard"
    if target == recorded + 1 and staged == recorded:
        return "commit"
    raise Refused(
        "half_applied",
        f"told to resolve up to clock {target}, but this shard is at {recorded} with "
        f"{'nothing' if staged == NONE else f'clock {staged}'} staged",
    )
