"""Message faults on the message plane, below authentication (issue 37 item 4, first part): a
process-wide plan (``NetFaults``, from ``$FLOTILLA_NET_FAULTS`` as JSON, or :func:`install`) makes
every client of the message plane lose, duplicate, delay or reorder the requests it sends, each
with its probability, decided by a seeded generator per client.  Installed in one place,
``ClientBase.call`` (``comm/base.py``); nothing outside ``comm/`` calls it.

What each fault does to a request (its signed frames, unchanged: the faults act below the
authentication layer, as a network would):

- ``drop``: never sent; the call times out (``CallTimeout``) and the caller's protocol retries.
- ``duplicate``: sent twice; the receiver's replay guard refuses the copy (``replay``) and the
  reply to it, carrying the same request id, is discarded by the client -- nothing applied twice.
- ``delay``: sent ``delay_s`` later.
- ``reorder``: held back and sent right after the next request of the same client, which
  overtakes it; the late one carries an older ``seq`` and the replay guard refuses it: a
  reordered request counts as a drop the protocol must retry (the call that sent it times out).
- ``lose_reply`` (drawn on its own, after a request got its reply): the request was delivered and
  applied, its reply is lost; the call waits out its deadline and times out, so the caller sends
  it again: only an idempotent request survives that (a join carries a token, a heartbeat a
  batch number, a repeated finish changes nothing).

``ops`` limits the faults to those request ops (e.g. the coordinator's control messages, or the
ring driver's peer messages, op ``ring``: ``tests/multiproc/test_coordinator_death.py``); empty:
every op.  ``counts`` says what was done (tests, benchmarks).

On the **liveness connections** (``comm/liveness.py``: they carry no data, only a goodbye, so a
network can only break them): ``liveness_reset`` is the probability, per held connection and per
poll of its watch (``POLL_S``), that the network resets it (the watch sends a reset and treats the
connection as ended without a goodbye): the watch must tell that from its peer's death
(:func:`reset_draw`).

On the **collective plane** (``comm/collective.Group``, gloo or NCCL over TCP: a stream that
neither loses, duplicates nor reorders what it delivers, so a network can only delay it --
``comm/shaping.py`` -- or break it): ``collective_reset`` is the probability, per collective or
point-to-point launch on a group of two or more members, that the network resets the group's
connections just before it: the group fails there (its backend released, so every peer blocked
on it sees its connections close) with every process still alive -- the protocol must tell that
from a death and train on (:func:`collective_reset_draw`).  Latency and bandwidth are
``comm/shaping.py``'s (``cluster.links.emulate``).
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["ENV_VAR", "FaultInjector", "NetFaults", "collective_reset_draw", "injector_for", "install"]

ENV_VAR = "FLOTILLA_NET_FAULTS"
KINDS = ("drop", "duplicate", "delay", "reorder")


@dataclass(frozen=True, kw_only=True, slots=True)
class NetFaults:
    drop: float = 0.0
    duplicate: float = 0.0
    delay: float = 0.0
    reorder: float = 0.0
    lose_reply: float = 0.0  # (drawn apart: the request was delivered and applied, its reply is lost)
    liveness_reset: float = 0.0  # (per liveness connection and watch poll: module doc)
    collective_reset: float = 0.0  # (per launch on a group of >= 2 members: module doc)
    delay_s: float = 0.05
    seed: int = 0
    ops: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for kind in KINDS:
            p = getattr(self, kind)
            if not (isinstance(p, int | float) and 0.0 <= p <= 1.0):
                raise ValueError(f"NetFaults.{kind} must be a probability in [0, 1], got {p!r}")
        for name in ("lose_reply", "liveness_reset", "collective_reset"):
            p = getattr(self, name)
            if not (isinstance(p, int | float) and 0.0 <= p <= 1.0):
                raise ValueError(f"NetFaults.{name} must be a probability in [0, 1], got {p!r}")
        if sum(getattr(self, k) for k in KINDS) > 1.0 + 1e-9:
            raise ValueError("NetFaults: drop + duplicate + delay + reorder must be <= 1")
        if not (isinstance(self.delay_s, int | float) and math.isfinite(self.delay_s) and self.delay_s >= 0):
            raise ValueError(f"NetFaults.delay_s must be a finite number >= 0, got {self.delay_s!r}")

    @property
    def active(self) -> bool:
        drawn_apart = (self.lose_reply, self.liveness_reset, self.collective_reset)
        return any(getattr(self, k) > 0 for k in KINDS) or any(p > 0 for p in drawn_apart)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "ops": list(self.ops)})

    @classmethod
    def from_json(cls, text: str) -> NetFaults:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("a message-fault plan is a JSON object")
        return cls(**{**raw, "ops": tuple(raw.get("ops", ()))})


_installed: NetFaults | None = None
_lock = threading.Lock()


def install(faults: NetFaults | None) -> None:
    """Set (or clear, None) the process-wide plan; clients made from now on follow it."""
    global _installed
    with _lock:
        _installed = faults


def _plan(env: Mapping[str, str] = os.environ) -> NetFaults | None:
    with _lock:
        if _installed is not None:
            return _installed
    text = env.get(ENV_VAR)
    return NetFaults.from_json(text) if text else None


class FaultInjector:
    """One client's faults: ``send(op, send, frames)`` instead of ``send(frames)``."""

    def __init__(self, faults: NetFaults, name: str) -> None:
        self.faults = faults
        self._rng = random.Random(faults.seed * 1_000_003 + zlib.crc32(name.encode()))
        self._held: list[Any] | None = None
        self.counts: Counter[str] = Counter()

    def send(self, op: str, send: Callable[[list[Any]], None], frames: list[Any]) -> None:
        f = self.faults
        held, self._held = self._held, None
        if f.ops and op not in f.ops:
            kind = "none"
        else:
            kind = self._draw()
        self.counts[kind] += 1
        if kind == "drop":
            pass
        elif kind == "duplicate":
            send(frames)
            send(frames)
        elif kind == "delay":
            time.sleep(f.delay_s)
            send(frames)
        elif kind == "reorder":
            self._held = frames
        else:
            send(frames)
        if held is not None:  # overtaken by the request just sent
            send(held)

    def reply_lost(self, op: str) -> bool:
        """Whether the reply to this request is lost (the caller then waits out its deadline)."""
        f = self.faults
        if f.lose_reply <= 0 or (f.ops and op not in f.ops):
            return False
        lost = self._rng.random() < f.lose_reply
        if lost:
            self.counts["lose_reply"] += 1
        return lost

    def _draw(self) -> str:
        r = self._rng.random()
        for kind in KINDS:
            p = getattr(self.faults, kind)
            if r < p:
                return kind
            r -= p
        return "none"


def injector_for(name: str, env: Mapping[str, str] = os.environ) -> FaultInjector | None:
    """The injector of a new client named ``name`` under the process-wide plan, or None."""
    faults = _plan(env)
    return FaultInjector(faults, name) if faults is not None and faults.active else None


def reset_draw(name: str, env: Mapping[str, str] = os.environ) -> Callable[[], bool] | None:
    """For a new liveness watch named ``name``: a seeded draw, True when the network resets a
    connection it holds at this poll (module doc); None without ``liveness_reset``."""
    return _draw(name, "liveness", "liveness_reset", env)


def collective_reset_draw(name: str, env: Mapping[str, str] = os.environ) -> Callable[[], bool] | None:
    """For a new collective group (``name``: its namespace and rank): a seeded draw, True when the
    network resets the group's connections before this launch (module doc); None without
    ``collective_reset``."""
    return _draw(name, "collective", "collective_reset", env)


def _draw(name: str, plane: str, field: str, env: Mapping[str, str]) -> Callable[[], bool] | None:
    """A seeded draw of the plan's probability ``field`` for ``name`` on ``plane`` (None: 0)."""
    faults = _plan(env)
    p = float(getattr(faults, field)) if faults is not None else 0.0
    if faults is None or p <= 0:
        return None
    rng = random.Random(faults.seed * 1_000_003 + zlib.crc32(f"{plane}/{name}".encode()))
    return lambda: rng.random() < p
