"""Strategy ``partial_reduce``: a local step, then the model average within a group of ready
workers that the coordinator's controller forms (SPEC §5; policy: ``sync/pr_plan.py``, runtime:
``sync/pr_service.py``, the strategy's service on the coordinator; settings and spec:
``sync/pr_settings.py``).

Per commit unit (one minibatch)::

    backward (loss = sum / global batch)   -> gradients scaled by ``grad_scale`` (N: the local mean)
    optimizer.step(); version += 1          # the local step X - eta G (momentum stays local)
    pr_ready(version)  ... poll ...         # the controller answers with an Assignment
    group: flat = w_me * state; all-reduce SUM over the group named by its namespace
    pr_done(ok) ... poll ...                # committed (every member reduced) or aborted
    committed: state = flat, version = max(group versions);  aborted: keep the local step
    done (every partner finished): this worker's training is over (``training_done``)

So X_{k+1} = (X_k - eta G_k) W_k with W_k the group's (CPR 1/P, DPR α^δ) weights.  The averaged
state is the trainable parameters and the floating-point buffers; the optimizer's state (momentum)
is each worker's own and is not averaged.

Atomicity: a member applies the group's result only after the controller committed the group,
which it does only when every member reported a completed all-reduce; a member that dies or stalls
makes the others' collective fail (closed connections, the broken epoch's abort of busy groups, or
``step_timeout_s``) or the controller drop it, and the group is aborted for all.  The local step is
kept either way (a worker's own update is never lost).  A failed group is closed at once, so peers
blocked on this member fail too.  Membership views are only reported and caught up with between
units (``Membership.catch_up``; docs/partial_reduce.md, "A member dies").

A worker that joins the running job (``StrategyContext.joined``) holds no model: in ``start``
it asks the controller as a newcomer (``fresh``) and takes the first group it is given with weight
0 -- the group's result is its holders' average (``sync/pr_plan.py``, "Newcomers"); an aborted
group is asked for again.  It then starts at the step its holders reached (``joined_at``); its
optimizer state (momentum) starts empty, as every worker's own.  No holder left: the model is
lost, and it stops with that error.

Groups are built through ``StrategyContext.groups`` (``comm/group_factory.py``) by the namespace
the controller names, one per member set (and per abort generation), cached: the set-up cost
(``group_setup_s`` in the records) is paid once per member set, not per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import nn

from flotilla.core.checks import require_choice, require_int, require_number
from flotilla.core.errors import CollectiveError
from flotilla.core.log import get_logger
from flotilla.sync.base import Outcome, Proposal, Regime, SyncStrategy, Traits
from flotilla.sync.plan import StateLost

__all__ = ["ControllerLink", "PartialReduce", "PartialReduceConfig"]

log = get_logger("partial_reduce")


@dataclass(frozen=True, kw_only=True, slots=True)
class PartialReduceConfig:
    """Package config of strategy ``partial_reduce`` (``PartialReduceStrategy.package``: the
    settings' defaults are the only ones; ``grad_scale`` and ``poll_s`` are the runtime's own)."""

    group_size: int
    weighting: Literal["constant", "dynamic"]
    alpha: float
    group_timeout_s: float
    step_timeout_s: float
    bridge_after: int
    grad_scale: float = 0.0  # multiply gradients by this before the local step; 0: num_workers
    poll_s: float = 0.002  # between polls of the controller

    def __post_init__(self) -> None:
        require_int("PartialReduceConfig", "group_size", self.group_size, min=2)
        require_choice("PartialReduceConfig", "weighting", self.weighting, ("constant", "dynamic"))
        require_number("PartialReduceConfig", "alpha", self.alpha, gt=0.0, max=1.0)
        require_number("PartialReduceConfig", "group_timeout_s", self.group_timeout_s, min=0.0)
        require_number("PartialReduceConfig", "step_timeout_s", self.step_timeout_s, gt=0.0)
        require_int("PartialReduceConfig", "bridge_after", self.bridge_after, min=0)
        require_number("PartialReduceConfig", "grad_scale", self.grad_scale, min=0.0)
        require_number("PartialReduceConfig", "poll_s", self.poll_s, gt=0.0)

    @property
    def effective_alpha(self) -> float:
        return 1.0 if self.weighting == "constant" else self.alpha


class ControllerLink(Protocol):
    def call(self, op: str, body: dict | None = None, timeout_s: float = 10.0) -> dict: ...


class PartialReduce(SyncStrategy):
    """One worker's side of partial reduce (see the module doc)."""

    kind = "partial_reduce"
    end_wait_s = 120.0  # (partners end together: the last ones once every other one finished)
    traits = Traits(regime=Regime.GROUPS, nominal_batch=True, takes_newcomers=True)

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: PartialReduceConfig,
        *,
        worker_id: int,
        num_workers: int,
        link: ControllerLink,
        groups: Callable[[], Any],
        joined: bool = False,
    ) -> None:
        self.model, self.optimizer, self.config = model, optimizer, config
        self.worker_id, self._link, self._groups = worker_id, link, groups
        self._scale = config.grad_scale or float(num_workers)
        self._state = [p for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]
        self.version = 0
        self._seq = 0
        self.last_assignment: dict[str, Any] | None = None
        self.last_committed = False
        self._record: dict[str, Any] = {}
        self._setup_s: dict[str, float] = {}
        self._mine: dict[str, Any] = {}  # namespace -> the group this worker reduced in
        self._left = False
        self._finished = False  # trained its last step (else a close is a leave: a switch, SIGTERM)
        self._done = False  # the controller said so: every partner finished
        self._step = 0
        self._joined = joined  # it joined the running job: a newcomer until a group fills it
        self._joined_at = 0

    def start(self) -> None:
        """A newcomer takes its first group's average (weight 0: the holders'), see the module doc."""
        while self._joined:
            body = {
                "worker_id": self.worker_id,
                "seq": self._next_seq(),
                "version": 0,
                "step": 0,
                "fresh": True,
            }
            a = self._await("pr_ready", body)
            if a["status"] == "lost":
                raise StateLost(
                    f"worker {self.worker_id} joined, but no live worker holds the model any more "
                    "(every worker that had it is gone; partial reduce keeps no checkpoint)"
                )
            if a["status"] != "group":  # done / stop: the job ends before it trained
                self._done = self._done or a["status"] in ("done", "stop")
                return
            self._in_group(a)
            if self.last_committed:
                self._joined, self._joined_at = False, int(a.get("step", 0))
                log.info(
                    "worker %d joined: filled by group %s at version %d, starts at step %d",
                    self.worker_id, a["members"], self.version, self._joined_at,
                )  # fmt: skip

    def joined_at(self) -> int:
        return self._joined_at

    def begin_step(self, step: int) -> None:
        self._step = step
        self.optimizer.zero_grad(set_to_none=True)

    def synchronize(self, proposal: Proposal = Proposal()) -> Outcome:
        if not proposal.local_ok:
            return Outcome.agreed_alone(proposal, committed=False)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None and self._scale != 1.0:
                    p.grad.mul_(self._scale)
        self.optimizer.step()
        self.version += 1
        t0 = time.perf_counter()
        a = self._await(
            "pr_ready",
            {
                "worker_id": self.worker_id,
                "seq": self._next_seq(),
                "version": self.version,
                "step": self._step + 1,
                "fresh": False,
            },
        )
        wait_s = time.perf_counter() - t0
        self.last_assignment, self.last_committed = a, False
        self._record = {"pr_wait_s": round(wait_s, 6), "pr_group_size": len(a.get("members", ())) or 1}
        if a["status"] == "group":
            self._in_group(a)
        self._done = a["status"] == "done"
        self._record.update(pr_version=self.version, pr_committed=self.last_committed)
        return Outcome.agreed_alone(proposal)

    def training_done(self) -> bool:
        return self._done

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _await(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """Poll the controller until its answer is no longer ``wait``."""
        while True:
            reply = self._link.call(op, body)
            if reply.get("status") != "wait":
                return reply
            time.sleep(self.config.poll_s)

    def _in_group(self, a: dict[str, Any]) -> None:
        members = [int(m) for m in a["members"]]
        weight = float(a["weights"][members.index(self.worker_id)])
        flat = torch.cat([t.detach().reshape(-1).float() for t in self._state]) * weight
        ok = True
        self._record["pr_group_id"] = int(a["group_id"])
        try:
            flat = self._reduce(str(a["namespace"]), members, flat)
        except CollectiveError as exc:
            ok = False
            self._record["pr_error"] = str(exc)[:200]
        reply = self._await(
            "pr_done", {"worker_id": self.worker_id, "group_id": int(a["group_id"]), "ok": ok}
        )
        if ok and reply["status"] == "committed":
            self._write(flat)
            self.version = max(int(v) for v in a["versions"])
            self.last_committed = True

    def _reduce(self, namespace: str, members: list[int], flat: torch.Tensor) -> torch.Tensor:
        """All-reduce ``flat`` over the group ``namespace``.  A failure releases the group at
        once (``Group.fail`` closes its connections, so a peer blocked on us fails too, instead of
        waiting out ``step_timeout_s``).  A cached group aborted while idle (a broken epoch aborts
        this worker's busy groups, and may land just after a reduction finished) is unusable: its
        peers hold theirs, and rebuilding it under the same namespace would meet nobody; it is
        closed and the group reported failed, so the controller names a new generation."""
        cached = self._mine.get(namespace)
        if cached is not None and cached.aborted:
            cached.fail("aborted while idle")
            raise CollectiveError(f"{namespace}: group aborted while idle ({cached.abort_reason})")
        fresh = namespace not in self._setup_s
        group = self._groups().get(namespace, members, self.worker_id)
        self._mine[namespace] = group
        if fresh:
            self._setup_s[namespace] = float(getattr(group, "setup_s", 0.0))
            self._record["pr_group_setup_s"] = round(self._setup_s[namespace], 6)
        try:
            group.allreduce(flat, op="sum")
        except CollectiveError:
            group.fail("partial reduce group failed")
            raise
        return flat

    def _write(self, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for t in self._state:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t).to(t.dtype))
                offset += n

    def record_fields(self) -> dict[str, Any]:
        return dict(self._record)

    def mark_finished(self) -> None:
        """The last step is trained: out of the controller's queue at once (:meth:`close`), so the
        reports that follow (records flushed, ``finish``: each may wait out a lost request's
        timeout) keep no partner waiting for a group with this worker."""
        self._finished = True
        self.close()

    def close(self) -> None:
        """Out of the controller's queue: as *finished* after the last step (a lagging partner is
        then told it is done), else as *left* (a strategy switch, a leave: the others train on)."""
        if self._left:
            return
        self._left = True
        body = {"worker_id": self.worker_id, "finished": self._finished}
        try:
            self._link.call("pr_leave", body, timeout_s=2.0)
        except Exception:  # (the coordinator may be gone at the end: it drops silent workers anyway)
            pass
