"""Strategy ``adpsgd``: asynchronous decentralised SGD (Lian et al., ICML'18; SPEC §6) -- no
barrier, no server: each worker averages its model with one random live peer, then applies its
own gradient.

Per commit unit (one minibatch), on worker ``i``::

    backward on x_i (read when the step began)  -> g_i (scaled to this worker's mean gradient)
    take the slot (waits while a peer's exchange with i is open; bounded)
    x_i = the averages committed with i as the passive side since the last step
    if i is active (``adpsgd_plan.roles``): pick a passive peer j (seeded), then
        prepare: send x_i, j answers avg = (x_i + x_j) / 2 and holds its slot for us
        commit:  j sets x_j = avg (applied at j's next step), i sets x_i = avg
    x_i = x_i - lr * step(g_i)                  # the job's optimizer, on the averaged weights
    release the slot

So every average is doubly stochastic (both ends take the same bytes), a worker's gradient may be
computed on weights an average has since moved (AD-PSGD's staleness), and fast workers never wait
for slow ones: a passive peer answers from its peer server's thread while it computes.

Guarantees
- **Atomic exchange**: the passive side applies the average only on ``commit``; an exchange whose
  active dies or stalls past ``exchange_timeout_s`` is aborted on the passive side, nothing applied;
  the active applies it only once the passive answered ``committed`` (a lost commit reply is
  resolved by asking: ``adpsgd_abort`` answers the exchange's outcome).  A half-applied exchange
  needs a live passive that the active cannot reach for ``exchange_timeout_s`` right after its
  commit: it is then logged (``adpsgd_outcome: unknown``) and counted, never silent.
- **Non-interleaving, no deadlock** (``adpsgd_plan.Slot``): one exchange or own step at a time
  touches a worker; a peer's request never waits for a slot (``busy``), and a worker waits only for
  its own slot, at most ``exchange_timeout_s``.
- **The final model is the average of the live replicas** (``finalize`` on the job's rank 0): once
  every other member has finished or died, it fetches each finished replica, averages them with
  its own in worker-id order (float64 sums), and exports that.
- Members come and go (``Regime.ALONE``): a dead worker is skipped (the coordinator's ``gone``, and
  any peer an exchange with failed); a joiner takes a live peer's replica and optimizer state and
  starts at its step (``start``), and the others learn of it from the directory's ``live``
  within ``status_every`` steps.  A lagging worker's training
  ends once every other live worker finished (``training_done``), as under partial reduce.

Records: ``adpsgd_peer``, ``adpsgd_xid``, ``adpsgd_outcome`` (``committed``, ``alone``, or why not),
``adpsgd_wait_s`` per unit, and ``adpsgd_served`` (the exchanges this worker took part in as the
passive side since its last record: ``[xid, active, outcome]``), from which a test checks that no
exchange was applied on one side only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from flotilla.cluster.launch_plan import LaunchNeeds
from flotilla.core.errors import CommError, ConfigError, PeerDisconnected, RemoteError
from flotilla.core.log import get_logger
from flotilla.sync import adpsgd_plan as plan
from flotilla.sync.adpsgd_join import Joining
from flotilla.sync.adpsgd_service import PeerDirectory
from flotilla.sync.base import Outcome, Proposal, Regime, SyncStrategy, Traits
from flotilla.sync.spec import PeerPlane, ServiceFacts, StrategyContext, StrategySettings, StrategySpec
from flotilla.sync.state import all_finite

__all__ = ["SPEC", "ADPSGD", "ADPSGDStrategy"]

log = get_logger("adpsgd")

XID = (str,)
RETRY_AFTER_STEPS = 100  # a peer an exchange failed with is tried again this many steps later
_GONE = "\x00gone"  # (``_ask``: the peer's connection dropped; no status a peer sends)


class ADPSGDStrategy(StrategySettings):
    """AD-PSGD: each step, an active worker averages its model with one random passive peer."""

    kind: Literal["adpsgd"] = "adpsgd"
    exchange_timeout_s: float = Field(default=2.0, gt=0, le=600)  # one exchange's bound
    attempts: int = Field(default=2, ge=1, le=64)  # peers tried per step (busy ones) before training alone
    seed: int = Field(default=0, ge=0, le=2**63 - 1)  # of the peer choice
    status_every: int = Field(default=5, ge=1, le=10**6)  # steps between asks of who finished
    final_timeout_s: float = Field(default=120.0, gt=0, le=86400)  # a finished worker serves its replica


class ADPSGD(Joining):
    """One worker's AD-PSGD (see the module doc)."""

    kind = "adpsgd"
    traits = Traits(regime=Regime.ALONE, nominal_batch=True)

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        settings: ADPSGDStrategy,
        *,
        worker_id: int,
        members: tuple[int, ...],
        num_workers: int,
        peers: PeerPlane,
        link: Any,
        gone: Callable[[], frozenset[int]] = frozenset,
        clock: Callable[[], float] = time.monotonic,
        joined: bool = False,
    ) -> None:
        self.model, self.optimizer, self.settings = model, optimizer, settings
        self.worker_id, self.members = worker_id, tuple(sorted(members))
        self._peers, self._link, self._gone, self._now = peers, link, gone, clock
        self._scale = float(num_workers)
        self._state = [p for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]
        self._numel = sum(t.numel() for t in self._state)
        self._slot = plan.Slot()
        self._cv = threading.Condition()
        self._pending: torch.Tensor | None = None  # the newest committed average (applied at our step)
        self._prepared: torch.Tensor | None = None  # the average of the exchange holding the slot
        self._served: list[list[Any]] = []  # [xid, active, outcome] as the passive side, not yet recorded
        self._suspected: dict[int, int] = {}  # peer -> the step an exchange with it failed
        self._finished: set[int] = set()
        self._dead: set[int] = set()
        self._lost_finals: set[int] = set()  # finished, then died before the consensus had its replica
        self._clients: dict[str, Any] = {}
        self._seq = 0
        self._step = 0
        self._units = 0
        self._done = False
        self._final = False  # this replica is final (trained its last step)
        self._linger_until: float | None = None  # (Ending: when serving the final replica stops)
        self._spectator = False  # joined as the job ended: out of the final average (adpsgd_join)
        self._closed = False
        self.unknown_outcomes = 0
        self._xv: list[int] = []
        self._record: dict[str, Any] = {}
        self._joined = joined  # it joined the running job: its state comes from a live peer (start)
        self._ready = not joined  # (until then it takes no average and lends no replica)
        self._joined_at = 0
        self._own_saved: torch.Tensor | None = None  # this replica, while rank 0 evaluates the average
        # versions (the oracle's replay, tests/multiproc/_adpsgd_oracle.py): every change of this
        # replica's weights -- an average (either side) or an own step -- makes a new version
        self.version = 0
        self._params_version = 0  # the version the parameters hold (averages apply at the step)
        self._grad_version = 0  # the version the running unit's gradient is computed on
        self._prepared_versions: tuple[int, int] = (0, 0)  # (ours, the active's) of the open exchange
        for op, handler, schema, tensors in (
            ("adpsgd_prepare", self._on_prepare, {"xid": XID, "active": int, "step": int, "version": int}, 1),
            ("adpsgd_commit", self._on_commit, {"xid": XID}, 0),
            ("adpsgd_abort", self._on_abort, {"xid": XID}, 0),
            ("adpsgd_final", self._on_final, {}, 0),
            ("adpsgd_peek", self._on_peek, {}, 0),
            ("adpsgd_state", self._on_state, {}, 0),
        ):
            peers.register(op, handler, schema, max_tensors=tensors)

    # ------------------------------------------------------------------ the worker's side
    def begin_step(self, step: int) -> None:
        self._end_eval()
        self._grad_version = self._params_version
        self._step = step
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ evaluation (rank 0)
    def before_eval(self) -> None:
        """Rank 0 evaluates what the job would export now: the average of the live replicas
        (each peer's current weights, ``adpsgd_peek``, in worker-id order, float64 sums).  Its
        own replica comes back before its next step; meanwhile it holds its slot (exchanges with
        it are answered ``busy``)."""
        if self._own_saved is not None:
            return
        self._take()
        self._apply_pending()
        own = self._flat()
        replicas = {self.worker_id: own}
        others = set(self.members) - {self.worker_id} - self._dead - set(self._gone()) - self._finished
        for w in sorted(others):
            flat = self._fetch(w, "adpsgd_peek", tries=20)
            if flat is not None:
                replicas[w] = flat
        self._own_saved = own
        self._write(self._average(replicas))
        self._record["adpsgd_eval_of"] = sorted(replicas)

    def checkpoint_state(self) -> bool:
        """The job's state for a checkpoint is what it would export: the average of the live
        replicas (as for an evaluation; rank 0's own replica comes back before its next step)."""
        self.before_eval()
        return True

    def synchronize(self, proposal: Proposal = Proposal()) -> Outcome:
        if not proposal.local_ok:
            return Outcome.agreed_alone(proposal, committed=False)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None and self._scale != 1.0:
                    p.grad.mul_(self._scale)
        t0 = time.perf_counter()
        self._take()
        try:
            self._apply_pending()
            self._record = self._exchange()
            self.optimizer.step()
            # (the gradient's version, the version it was applied to, the gradients' scale)
            self._record["adpsgd_v"] = [self._grad_version, self.version, self._scale]
            self.version += 1
            self._params_version = self.version
        finally:
            self._release()
        self._record["adpsgd_wait_s"] = round(time.perf_counter() - t0, 6)
        with self._cv:
            if self._served:
                self._record["adpsgd_served"], self._served = self._served, []
        self._units += 1
        return Outcome.agreed_alone(proposal)

    def _exchange(self) -> dict[str, Any]:
        """Average with one passive peer, if this worker is active (the slot is held)."""
        tried: list[int] = []
        why = "alone"
        for attempt in range(self.settings.attempts):
            among = plan.candidates(
                self.worker_id,
                self.members,
                gone=self._gone() | self._dead,
                finished=self._finished,
                suspected=self._still_suspected() | set(tried),
            )
            peer = plan.choose_peer(self.settings.seed, self.worker_id, self._step, attempt, among)
            if peer is None:
                break
            tried.append(peer)
            self._seq += 1
            xid = f"{self.worker_id}:{self._seq}"
            why = self._exchange_with(peer, xid)
            if why == "committed":
                return {"adpsgd_peer": peer, "adpsgd_xid": xid, "adpsgd_outcome": why, "adpsgd_xv": self._xv}
        return {"adpsgd_peer": tried[-1] if tried else None, "adpsgd_outcome": why}

    def _exchange_with(self, peer: int, xid: str) -> str:
        address = self._peers.address_of(peer)
        if address is None:
            self._suspected[peer] = self._step
            return "no address"
        client = self._client(address)
        mine = self._flat()
        timeout = self.settings.exchange_timeout_s
        try:
            reply = client.call(
                "adpsgd_prepare",
                {"xid": xid, "active": self.worker_id, "step": self._step, "version": self.version},
                [mine],
                timeout_s=timeout,
            )  # fmt: skip
        except RemoteError as exc:  # (refused: e.g. no strategy there now, a switch)
            return f"refused ({exc.code})"
        except CommError as exc:  # (a timeout: dead or stalled) -- nothing was prepared for us
            self._suspect(peer, address, exc)
            return "unreachable"
        status = reply.body.get("status")
        if status == "closed":  # (finished; "starting": a joiner still taking its state)
            self._finished.add(peer)
            return "finished"
        if status != "prepared":
            return str(status)
        avg = reply.tensors[0] if len(reply.tensors) == 1 else None
        if avg is None or avg.dtype != torch.float32 or avg.numel() != self._numel or not all_finite([avg]):
            self._ask(client, "adpsgd_abort", xid)
            log.warning(
                "worker %d: peer %d answered exchange %s with a bad average: aborted",
                self.worker_id,
                peer,
                xid,
            )
            return "bad reply"
        outcome = self._ask(client, "adpsgd_commit", xid)
        if outcome is None:  # (no answer: ask how it ended before giving up)
            outcome = self._ask(client, "adpsgd_abort", xid)
        if outcome == _GONE:  # (its process died: what it prepared died with it; nothing applied here)
            self._suspect(peer, address, PeerDisconnected("its connection dropped before it answered commit"))
            return "unreachable"
        if outcome == "committed":
            self._write(avg.reshape(-1))
            self._xv = [self.version, int(reply.body.get("version", -1))]  # (ours, the peer's) before
            self.version += 1
            self._params_version = self.version
            return "committed"
        if outcome is None:
            self.unknown_outcomes += 1
            self._suspect(peer, address, CommError("no answer to commit nor abort"))
            log.error(
                "worker %d: exchange %s with peer %d: outcome unknown (not applied here)",
                self.worker_id,
                xid,
                peer,
            )
            return "unknown"
        return str(outcome)

    def _ask(self, client: Any, op: str, xid: str) -> str | None:
        """The peer's answer to ``op`` on exchange ``xid``; None: none in time; ``_GONE``: its
        connection dropped (its process died)."""
        try:
            return str(
                client.call(op, {"xid": xid}, timeout_s=self.settings.exchange_timeout_s).body.get("status")
            )
        except PeerDisconnected:
            return _GONE
        except CommError:
            return None

    def _still_suspected(self) -> set[int]:
        return {p for p, at in self._suspected.items() if self._step - at < RETRY_AFTER_STEPS}

    def _suspect(self, peer: int, address: str, exc: Exception) -> None:
        self._suspected[peer] = self._step
        client = self._clients.pop(address, None)
        if client is not None:
            client.close()
        log.warning("worker %d: peer %d unreachable (%s): skipped for %d steps (or until the coordinator "
                    "declares it dead)", self.worker_id, peer, exc, RETRY_AFTER_STEPS)  # fmt: skip

    def record_fields(self) -> dict[str, Any]:
        return dict(self._record)


def _build(
    model: nn.Module, optimizer: torch.optim.Optimizer, config: Any, ctx: StrategyContext
) -> SyncStrategy:
    if not isinstance(config, ADPSGDStrategy):
        raise TypeError(f"strategy adpsgd needs ADPSGDStrategy settings, got {type(config).__name__}")
    if ctx.peers is None or ctx.coordinator is None:
        raise ConfigError("strategy adpsgd needs a peer plane and a coordinator (flotilla run)")
    return ADPSGD(
        model,
        optimizer,
        config,
        worker_id=ctx.worker_id,
        members=ctx.members or (ctx.worker_id,),
        num_workers=ctx.num_workers,
        peers=ctx.peers,
        link=ctx.coordinator,
        gone=ctx.gone or frozenset,
        joined=ctx.joined,
    )


def _service(settings: ADPSGDStrategy, facts: ServiceFacts) -> PeerDirectory:
    return PeerDirectory.of_facts(facts)


SPEC = StrategySpec(
    kind="adpsgd",
    settings=ADPSGDStrategy,
    # (checkpoints: the average of the live replicas, ``checkpoint_state``)
    launch=LaunchNeeds(gpu=True, auto_checkpoint=True),
    simulated="flotilla.sim.adpsgd:adpsgd_of",
    build=_build,
    service=_service,
    summary="AD-PSGD: no barrier, no server; each step an active worker averages with a random passive peer",
)
