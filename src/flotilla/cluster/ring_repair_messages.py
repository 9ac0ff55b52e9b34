"""Data of the ring-repair protocol (``ring_repair.py``), pure: ballots, messages, events, effects
and one worker's state.

Everything here is plain data (ints, tuples of ints, strings, bools) so the driver can encode a
``Message`` with msgpack through ``to_dict``/``from_dict``.  A ``Message`` validates itself on
construction: a malformed one (wrong types, unknown kind, unsorted or negative members, a field
that makes no sense for its kind) raises ``ValueError`` and never reaches the state machine.
Checks against the receiver's view (epoch, membership) are the state machine's, which answers a
``Rejected`` effect; ``from_dict(data, view=...)`` runs the same checks for a driver that wants to
refuse a frame before it reaches the machine.

Ballots.  A ballot names one pass of a repair round: ``(generation, initiator, attempt)``.  A
higher generation outranks a lower one (a *takeover*, started when a round's initiator is known
dead); within a generation the **lower initiator id wins**; within one initiator's round a later
attempt outranks an earlier one.  ``(generation, initiator)`` is the round's *family*.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flotilla.cluster.membership import View

__all__ = [
    "ACCEPT",
    "ACK",
    "COMMIT",
    "KINDS",
    "PASS_KINDS",
    "PROBE",
    "RECONCILE",
    "Adopt",
    "Ballot",
    "Effect",
    "Event",
    "Evicted",
    "Message",
    "Outbound",
    "ProbeDue",
    "Proposal",
    "Received",
    "Rejected",
    "RepairState",
    "RetryDue",
    "Round",
    "Send",
    "Suspect",
    "best",
    "outside",
]

RECONCILE = "reconcile"  # phase 1: promise the ballot, report accepted proposals, drop the dead
ACCEPT = "accept"  # phase 2: accept the proposed members (the pass that must come back unchanged)
COMMIT = "commit"  # the chosen members: adopt them
ACK = "ack"  # hop-by-hop acknowledgement of a RECONCILE, ACCEPT or COMMIT
# (what an ACK names as ``acked`` when it acknowledges nothing: a waiting worker's question "did
# you move on without me?"; it can never be taken for the acknowledgement of a pass or a commit)
PROBE = "probe"
PASS_KINDS = (RECONCILE, ACCEPT)
KINDS = (RECONCILE, ACCEPT, COMMIT, ACK)


def _check_id(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def _check_members(name: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of worker ids, got {value!r}")
    ids = tuple(_check_id(name, v) for v in value)
    if tuple(sorted(set(ids))) != ids:
        raise ValueError(f"{name} must be unique and sorted, got {ids}")
    return ids


@dataclass(frozen=True, slots=True)
class Ballot:
    """One pass of one round; see the module docstring for the order."""

    generation: int
    initiator: int
    attempt: int

    def __post_init__(self) -> None:
        for name in ("generation", "initiator", "attempt"):
            _check_id(name, getattr(self, name))

    @property
    def rank(self) -> tuple[int, int, int]:
        """Sort key: a larger rank outranks a smaller one."""
        return (self.generation, -self.initiator, self.attempt)

    @property
    def family(self) -> tuple[int, int]:
        """The round this pass belongs to: ``(generation, initiator)``."""
        return (self.generation, self.initiator)

    def outranks(self, other: Ballot | None) -> bool:
        return other is None or self.rank > other.rank


@dataclass(frozen=True, slots=True)
class Proposal:
    """Members accepted (phase 2) under a ballot."""

    ballot: Ballot
    members: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_members("members", self.members)


def best(*proposals: Proposal | None) -> Proposal | None:
    """The proposal with the highest-ranked ballot, ``None`` if there is none."""
    found = [p for p in proposals if p is not None]
    return max(found, key=lambda p: p.ballot.rank) if found else None


@dataclass(frozen=True, kw_only=True, slots=True)
class Message:
    """One protocol message of the repair of view ``epoch``.

    ``members``: the proposed (RECONCILE, ACCEPT) or chosen (COMMIT) members, empty for an ACK.
    ``forced``: the members are the value of an earlier accepted proposal and may not be
    shrunk on the way.  ``prior``: the highest-ranked proposal of another round accepted by a
    worker this pass visited (phase-1 report).  ``acked``: the kind an ACK acknowledges
    (``PROBE``: none -- a probe).
    """

    kind: str
    sender: int
    epoch: int
    ballot: Ballot
    members: tuple[int, ...] = ()
    forced: bool = False
    prior: Proposal | None = None
    acked: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        _check_id("sender", self.sender)
        _check_id("epoch", self.epoch)
        _check_members("members", self.members)
        if not isinstance(self.forced, bool):
            raise ValueError(f"forced must be a bool, got {self.forced!r}")
        if self.kind == ACK:
            self._check_ack()
        else:
            self._check_proposal()

    def _check_ack(self) -> None:
        if self.acked not in (RECONCILE, ACCEPT, COMMIT, PROBE):
            raise ValueError(f"an ack must name the kind it acknowledges, got {self.acked!r}")
        if self.members or self.forced or self.prior is not None:
            raise ValueError("an ack carries no members, forced flag or prior")

    def _check_proposal(self) -> None:
        if self.acked:
            raise ValueError(f"only an ack names an acked kind, got {self.acked!r} on {self.kind}")
        if not self.members:
            raise ValueError(f"a {self.kind} must propose at least one member")
        relays = self.kind == COMMIT  # a commit is relayed by whoever knows it, even one it evicts
        if not relays and self.sender not in self.members and self.sender != self.initiator:
            raise ValueError(f"sender {self.sender} is neither a proposed member nor the initiator")
        if self.kind == COMMIT and (self.forced or self.prior is not None):
            raise ValueError("a commit carries no forced flag or prior")
        if self.kind in PASS_KINDS and not self.forced and self.initiator not in self.members:
            raise ValueError(f"initiator {self.initiator} missing from an unforced {self.kind}")
        if self.prior is not None and self.prior.ballot.family == self.ballot.family:
            raise ValueError("a prior reports another round, not the message's own")

    @property
    def initiator(self) -> int:
        return self.ballot.initiator

    def ack(self, sender: int) -> Message:
        """The acknowledgement ``sender`` returns for this message."""
        return Message(kind=ACK, sender=sender, epoch=self.epoch, ballot=self.ballot, acked=self.kind)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (ints, lists, strings, bools, None) for msgpack."""
        prior = None
        if self.prior is not None:
            prior = {**_ballot_dict(self.prior.ballot), "members": list(self.prior.members)}
        return {
            "kind": self.kind,
            "sender": self.sender,
            "epoch": self.epoch,
            **_ballot_dict(self.ballot),
            "members": list(self.members),
            "forced": self.forced,
            "prior": prior,
            "acked": self.acked,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, view: View | None = None) -> Message:
        """Decode and validate; ``ValueError`` on anything malformed.  With ``view``, also refuse
        a message of another epoch or one naming a worker outside ``view``."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a message must be a mapping, got {type(data).__name__}")
        unknown = set(data) - _KEYS
        missing = _REQUIRED - set(data)
        if unknown or missing:
            raise ValueError(f"message keys: unknown {sorted(unknown)}, missing {sorted(missing)}")
        prior = data.get("prior")
        if prior is not None:
            if not isinstance(prior, Mapping) or set(prior) != _PRIOR_KEYS:
                raise ValueError(f"prior must be a mapping with keys {sorted(_PRIOR_KEYS)}")
            prior = Proposal(_ballot(prior), _check_members("prior members", prior["members"]))
        acked = data.get("acked", "")
        if not isinstance(acked, str) or not isinstance(data["kind"], str):
            raise ValueError("kind and acked must be strings")
        message = cls(
            kind=data["kind"],
            sender=_check_id("sender", data["sender"]),
            epoch=_check_id("epoch", data["epoch"]),
            ballot=_ballot(data),
            members=_check_members("members", data["members"]),
            forced=data.get("forced", False),
            prior=prior,
            acked=acked,
        )
        if view is not None:
            problem = outside(message, view)
            if problem:
                raise ValueError(problem)
        return message


def outside(message: Message, view: View) -> str:
    """Why ``message`` does not belong to the repair of ``view`` ('' if it does)."""
    if message.epoch != view.epoch:
        return f"epoch {message.epoch} is not the view's epoch {view.epoch}"
    named = {message.sender, message.initiator, *message.members}
    if message.prior is not None:
        named |= {message.prior.ballot.initiator, *message.prior.members}
    strangers = sorted(named - set(view.members))
    if strangers:
        return f"names workers {strangers} outside view {view.epoch}"
    return ""


_BALLOT_KEYS = ("generation", "initiator", "attempt")
_PRIOR_KEYS = {*_BALLOT_KEYS, "members"}
_REQUIRED = {"kind", "sender", "epoch", *_BALLOT_KEYS, "members"}
_KEYS = _REQUIRED | {"forced", "prior", "acked"}


def _ballot_dict(ballot: Ballot) -> dict[str, int]:
    return {"generation": ballot.generation, "initiator": ballot.initiator, "attempt": ballot.attempt}


def _ballot(data: Mapping[str, Any]) -> Ballot:
    return Ballot(*(_check_id(k, data[k]) for k in _BALLOT_KEYS))


# ---- events into the machine -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Suspect:
    """Local detection: a collective with these workers failed, or they missed heartbeats, or a
    send to them failed."""

    worker_ids: frozenset[int]


@dataclass(frozen=True, slots=True)
class Received:
    """A message arrived (already authenticated and decoded by the message plane)."""

    message: Message


@dataclass(frozen=True, slots=True)
class RetryDue:
    """The driver's retransmission timer fired: re-send what is unacknowledged."""


@dataclass(frozen=True, slots=True)
class ProbeDue:
    """The driver's probe timer fired while this worker waits for a view: ask the other live
    members whether they moved on without it (``ring_repair.probe``)."""


Event = Suspect | Received | RetryDue | ProbeDue


# ---- effects out of it -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    dst: int
    message: Message


@dataclass(frozen=True, slots=True)
class Adopt:
    """Run ``view`` from now on (restart synchronisation on its ring)."""

    view: View


@dataclass(frozen=True, slots=True)
class Evicted:
    """``view`` was chosen without this worker: stop, and rejoin as a newcomer."""

    view: View


@dataclass(frozen=True, slots=True)
class Rejected:
    """A message was refused (for the driver's log); it changed no state."""

    reason: str
    message: Message | None = None


Effect = Send | Adopt | Evicted | Rejected


# ---- one worker's state -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Outbound:
    """The last message sent on one channel (a pass, or a commit), kept to re-send it on
    ``RetryDue`` until acknowledged and to re-route it when ``dst`` turns out dead."""

    dst: int
    message: Message
    acked: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Round:
    """This worker's own round: its current pass's ``ballot`` and the ``constraint`` (the
    highest proposal of another round reported so far, whose members it must propose)."""

    ballot: Ballot
    constraint: Proposal | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RepairState:
    """One worker's protocol state.  ``dead``: members of ``view`` known dead.  The next four
    belong to the repair of ``view`` and are reset when a view is adopted: ``promised`` (the
    highest ballot forwarded), ``accepted`` (per round, the last proposal accepted), ``own``
    (this worker's round while it leads one), ``pass_out``.  ``commits_out``: commits sent, kept
    until acknowledged (an earlier epoch's too, while its destination is a member).
    ``last_commit``: the COMMIT that made ``view`` (sent to stragglers).  ``evicted``: the view
    chosen without us (the state is final)."""

    me: int
    view: View
    dead: frozenset[int] = frozenset()
    promised: Ballot | None = None
    accepted: tuple[Proposal, ...] = ()
    own: Round | None = None
    pass_out: Outbound | None = None
    commits_out: tuple[Outbound, ...] = ()
    last_commit: Message | None = None
    evicted: View | None = None
