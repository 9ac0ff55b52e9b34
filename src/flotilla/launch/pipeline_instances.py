"""The launcher's side of losing a pipeline instance (``strategy.replicas`` > 1; the rule is
``pipeline/replicas.py``'s): when a stage process exits with an error while another instance is
whole, the other stages of its instance are killed and the next generation of survivors is
announced in the attempt's rendezvous store (signed with the cluster secret, as every value
there); the survivors re-form and train on, no restart.  Each loss is recorded (which stage, its
exit code, the step the job had reached, when) for the summary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from flotilla.comm.store import StoreAddress, connect_store
from flotilla.core.log import get_logger
from flotilla.launch.supervisor import Child, Supervisor, kill_all
from flotilla.pipeline.replicas import Generation, generation_key, lead_of, survivors_after

__all__ = ["InstanceWatch", "lost_note"]

log = get_logger("pipeline-job")


@dataclass
class InstanceWatch:
    """The surviving instances of one attempt and the losses so far."""

    names: list[str]  # one per stage process, in order
    num_stages: int
    replicas: int
    store: StoreAddress | None = None
    secret: bytes | None = None
    timeout_s: float = 30.0
    generation: Generation = field(init=False)
    lost: list[dict[str, Any]] = field(default_factory=list)  # (the caller's: every attempt's losses)
    _client: Any = None

    def __post_init__(self) -> None:
        self.generation = Generation(1, tuple(range(self.replicas)))

    @property
    def lead(self) -> int:
        return lead_of(self.generation)

    def out(self, child: Child) -> bool:
        """Whether ``child`` belongs to an instance already lost (its exit changes nothing)."""
        return self.names.index(child.name) // self.num_stages not in self.generation.instances

    def lose(self, sup: Supervisor, child: Child, reached_step: int) -> bool:
        """``child`` (a stage process) failed: if another instance is whole, kill the rest of its
        instance, announce the survivors and return True; False when no whole instance is left
        (the caller's failure path: a restart from the checkpoint)."""
        index = self.names.index(child.name)
        nxt = survivors_after(self.generation, index, self.num_stages)
        if nxt is None:
            return False
        if nxt is self.generation:
            return True  # (its instance was lost already)
        instance = index // self.num_stages
        mates = {self.names[instance * self.num_stages + i] for i in range(self.num_stages)}
        kill_all([c for c in sup.alive("stage") if c.name in mates], grace_s=0.0)
        self._announce(nxt)
        self.lost.append(
            {
                "instance": instance,
                "stage": child.name,
                "exit_code": child.returncode,
                "reached_step": reached_step,
                "at": time.time(),
                "survivors": list(nxt.instances),
            }
        )
        log.warning(
            "pipeline instance %d lost (stage %s exited with code %s, the job at step %d); "
            "instances %s train on (generation %d)",
            instance,
            child.name,
            child.returncode,
            reached_step,
            ", ".join(map(str, nxt.instances)),
            nxt.number,
        )
        return True

    def _announce(self, nxt: Generation) -> None:
        if self.store is None:
            raise RuntimeError("InstanceWatch: no store to announce generations in")
        if self._client is None:
            self._client = connect_store(self.store, self.timeout_s, secret=self.secret)
        self._client.set(generation_key(nxt.number), nxt.to_bytes())
        self.generation = nxt


def lost_note(lost: list[dict[str, Any]]) -> str | None:
    """What a completed run went through (None: no instance was lost)."""
    if not lost:
        return None
    parts = [f"instance {e['instance']} ({e['stage']}, exit code {e['exit_code']})" for e in lost]
    return f"lost pipeline {', '.join(parts)}; instances {lost[-1]['survivors']} trained on"
