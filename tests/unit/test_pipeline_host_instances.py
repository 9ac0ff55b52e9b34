"""A hosted pipeline job's instances (``launch/pipeline_host_instances.py``): what it frees, plans,
announces and voids, driven with a recording host and an in-memory store (no processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flotilla.launch.pipeline_host_instances import HostedInstances
from flotilla.pipeline.layout import Layout
from flotilla.pipeline.replicas import (
    Generation,
    RegroupWatch,
    broken_key,
    generation_key,
    joined_key,
    plan_key,
    ready_key,
)
from flotilla.roles.stage_host_protocol import HostView

from ._store import Store


@dataclass
class Job:
    layout: Layout
    stage_names: list[str]


@dataclass
class Host:
    """What ``HostedInstances`` calls on ``StageHost``, recorded."""

    job: Job
    released: list[tuple[int, Any, str]] = field(default_factory=list)
    admitted: list[tuple[list[int], int]] = field(default_factory=list)
    arrivals: list[int] = field(default_factory=list)
    stopped: list[tuple[list[int], str]] = field(default_factory=list)

    def release(self, index: int, join: Any = 0, why: str = "") -> None:
        self.released.append((index, join, why))

    def admit(self, indices: list[int], join: int, *, arrival: int = 0) -> None:
        self.admitted.append((list(indices), join))
        self.arrivals.append(arrival)

    def stop_processes(self, indices: list[int], why: str) -> None:
        self.stopped.append((list(indices), why))

    def describe(self, index: int) -> str:
        return self.job.layout.describe(index, self.job.stage_names)


def view(claimed=(), dead=(), silent=(), failures=None) -> HostView:
    return HostView(
        claimed=tuple(claimed), missing=(), results=(), failures=dict(failures or {}),
        silent=tuple(silent), dead=tuple(dead), quiet=(),
    )  # fmt: skip


def make(
    instances: int = 2, bring_back: bool = True, alone: bool = False
) -> tuple[HostedInstances, Host, Store]:
    names = [f"{chr(97 + r)}{i}" for r in range(instances) for i in range(2)]
    host = Host(Job(Layout.uniform(2, instances), names))
    inst = HostedInstances(host, b"s" * 32, 5.0, bring_back=bring_back, alone=alone)  # type: ignore[arg-type]
    store = Store()
    inst._store = store
    return inst, host, store


def test_a_lost_instance_is_freed_planned_once_all_its_stages_are_held_and_announced_once_ready() -> None:
    inst, host, store = make()
    lost_to: list[tuple[int, int]] = []
    inst.on_lost = lambda instance, arrival: lost_to.append((instance, arrival))
    assert inst.lose(3, "its process is gone", 12)
    assert inst.generation == Generation(2, (0,)) and lost_to == [(1, 0)] and inst.processes() == [0, 1]
    assert Generation.from_bytes(store.kv[generation_key(2)]) == Generation(2, (0,))
    assert host.stopped == [([2, 3], "pipeline instance 1 lost: its process is gone")]
    assert [(g, j) for g, j, _ in host.released] == [(2, None), (3, None)]  # (free, generation later)
    assert all("pipeline instance 1 lost" in why for _, _, why in host.released)
    assert inst.newcomers() == [2, 3]

    inst.poll(view(claimed=(0, 1, 2)), 13)  # (one newcomer in: nothing planned)
    assert host.admitted == [] and plan_key(3) not in store.kv
    inst.poll(view(claimed=(0, 1, 2, 3)), 14)
    assert host.admitted == [([2, 3], 3)]
    assert Generation.from_bytes(store.kv[plan_key(3)]) == Generation(3, (0, 1))
    inst.poll(view(claimed=(0, 1, 2, 3)), 15)  # (not ready yet)
    assert generation_key(3) not in store.kv and inst.returned == []
    store.set(ready_key(3, 2), b"1")
    store.set(ready_key(3, 3), b"1")
    inst.poll(view(claimed=(0, 1, 2, 3)), 16)
    assert Generation.from_bytes(store.kv[generation_key(3)]) == Generation(3, (0, 1))
    assert inst.generation == Generation(3, (0, 1)) and inst.processes() == [0, 1, 2, 3]
    assert [(e["instance"], e["reached_step"], e["instances"]) for e in inst.returned] == [(1, 16, [0, 1])]
    assert inst.newcomers() == [] and "back: instance(s) 1" in (inst.note() or "")


def test_a_newcomer_that_dies_before_its_plan_frees_only_its_own_process() -> None:
    inst, host, _ = make()
    inst.lose(2, "failed", 3)
    host.released.clear()
    inst.poll(view(claimed=(0, 1, 2), dead=(2,)), 4)
    assert [(g, j) for g, j, _ in host.released] == [(2, None)] and host.admitted == []
    inst.poll(view(claimed=(0, 1, 3)), 5)  # (released: no longer claimed, not freed twice)
    assert len(host.released) == 1 and host.admitted == []


def test_a_planned_newcomer_that_fails_voids_the_plan_and_its_stale_readiness() -> None:
    inst, host, store = make()
    lost_to: list[tuple[int, int]] = []
    # (e.g. hetpipe's servers: what the newcomers took is released)
    inst.on_lost = lambda instance, arrival: lost_to.append((instance, arrival))
    inst.lose(3, "gone", 3)
    assert lost_to == [(1, 0)]
    inst.poll(view(claimed=(0, 1, 2, 3)), 4)
    assert host.admitted == [([2, 3], 3)]
    store.set(ready_key(3, 2), b"1")  # (one said it was ready, then failed)
    host.released.clear()
    inst.poll(view(claimed=(0, 1, 2, 3), failures={3: ("own", "boom")}), 5)
    assert sorted(g for g, _, _ in host.released) == [2, 3]
    assert all(
        "is not coming back for now" in why and "start its stages again" in why for *_, why in host.released
    )
    assert ready_key(3, 2) not in store.kv and generation_key(3) not in store.kv
    assert inst.generation == Generation(2, (0,)) and inst.newcomers() == [2, 3]
    # (the voided plan's newcomers given up: told as a loss of the instance, with their arrival)
    assert lost_to == [(1, 0), (1, 1)]
    # started again: planned again under the same number as a new arrival (a hetpipe VW's new worker
    # id is not the voided plan's, which its servers evicted), only its own newcomers' readiness counts
    inst.poll(view(claimed=(0, 1, 2, 3)), 6)
    assert host.admitted[-1] == ([2, 3], 3) and host.arrivals == [1, 2]
    store.set(ready_key(3, 3), b"1")
    inst.poll(view(claimed=(0, 1, 2, 3)), 7)
    assert generation_key(3) not in store.kv  # (stage 0's newcomer has not said it is ready)


def test_a_loss_while_an_instance_comes_back_voids_its_plan_and_takes_the_next_number() -> None:
    inst, host, store = make(instances=3)
    inst.lose(5, "gone", 3)  # (instance 2 out: generation 2 of 0, 1)
    inst.poll(view(claimed=tuple(range(6))), 4)
    assert host.admitted == [([4, 5], 3)]
    assert inst.lose(1, "gone", 5)  # (instance 0 out while 2 was coming: generation 3 of 1 alone)
    assert inst.generation == Generation(3, (1,))
    assert Generation.from_bytes(store.kv[generation_key(3)]) == Generation(3, (1,))
    assert inst.newcomers() == [4, 5, 0, 1]  # (2 first: it was waiting before 0)
    inst.poll(view(claimed=tuple(range(6))), 6)
    assert host.admitted[-1] == ([4, 5], 4)  # (one at a time, the plan after the survivors')
    assert Generation.from_bytes(store.kv[plan_key(4)]) == Generation(4, (1, 2))


def test_instances_that_stand_alone_are_dropped_and_never_freed() -> None:
    inst, host, store = make(bring_back=False)
    assert inst.lose(0, "gone", 3) and inst.generation == Generation(2, (1,))
    assert host.released == [] and inst.newcomers() == []
    inst.poll(view(claimed=(1, 2, 3)), 4)
    assert host.admitted == [] and plan_key(3) not in store.kv
    assert not inst.lose(2, "gone", 5)  # (no whole instance left: the job ends)


def _announced_back() -> tuple[HostedInstances, Store]:
    inst, _host, store = make()
    inst.lose(3, "gone", 3)
    inst.poll(view(claimed=(0, 1, 2, 3)), 4)
    store.set(ready_key(3, 2), b"1")
    store.set(ready_key(3, 3), b"1")
    inst.poll(view(claimed=(0, 1, 2, 3)), 5)
    assert inst.generation == Generation(3, (0, 1)) and len(inst.returned) == 1
    return inst, store


def test_an_instance_announced_back_whose_newcomers_never_got_the_state_is_out_at_the_end() -> None:
    inst, _ = _announced_back()
    assert inst.joining() == [2, 3]
    assert inst.drop_joining() == [2, 3]
    assert inst.generation == Generation(3, (0,)) and inst.processes() == [0, 1]
    assert inst.returned == [] and "back:" not in (inst.note() or "")


def test_once_its_newcomers_hold_the_state_the_instance_is_in_like_any_other() -> None:
    inst, store = _announced_back()
    store.set(joined_key(3, 2), b"1")
    assert inst.joining() == [2, 3]  # (one of two)
    store.set(joined_key(3, 3), b"1")
    assert inst.joining() == [] and inst.drop_joining() == []
    assert inst.generation == Generation(3, (0, 1)) and len(inst.returned) == 1


def test_a_newcomer_lost_after_its_announcement_takes_the_return_back() -> None:
    inst, _ = _announced_back()
    assert inst.lose(2, "gone", 6)  # (before it received the state)
    assert inst.generation == Generation(4, (0,)) and inst.returned == [] and inst.joining() == []


def test_a_group_broken_with_every_instance_alive_regroups_the_same_instances_after_the_grace() -> None:
    inst, host, store = make()
    inst._regroups = RegroupWatch(grace_s=0.0)
    inst.poll(view(claimed=(0, 1, 2, 3)), 3)
    assert generation_key(2) not in store.kv  # (nothing broke)
    store.set(broken_key(1), b"1")  # (a stage found its group broken and no loss announced)
    inst.poll(view(claimed=(0, 1, 2, 3)), 4)
    assert Generation.from_bytes(store.kv[generation_key(2)]) == Generation(2, (0, 1))
    assert inst.generation == Generation(2, (0, 1)) and inst.lost == [] and host.stopped == []
    assert [e["generation"] for e in inst.regrouped] == [2]
    inst.poll(view(claimed=(0, 1, 2, 3)), 5)  # (generation 1's key is old news)
    assert generation_key(3) not in store.kv


def test_instances_that_stand_alone_all_lost_wait_with_none_for_their_stages_to_be_started_again() -> None:
    """HetPipe's VWs under ``flotilla coordinator``: the last one lost leaves a generation of none
    (the servers hold the state); the first whose stages are held again comes back alone."""
    inst, host, store = make(alone=True)
    assert inst.lose(3, "its process is gone", 12) and inst.lose(1, "its process is gone", 13)
    assert inst.generation == Generation(3, ()) and inst.processes() == []
    assert Generation.from_bytes(store.kv[generation_key(3)]) == Generation(3, ())
    assert inst.lost[-1]["survivors"] == [] and sorted(inst.newcomers()) == [0, 1, 2, 3]
    inst.poll(view(claimed=(0, 1)), 14)  # (VW 0's stages started again first)
    assert host.admitted == [([0, 1], 4)]
    assert Generation.from_bytes(store.kv[plan_key(4)]) == Generation(4, (0,))
    store.set(ready_key(4, 0), b"1")
    store.set(ready_key(4, 1), b"1")
    inst.poll(view(claimed=(0, 1)), 15)
    assert inst.generation == Generation(4, (0,)) and inst.processes() == [0, 1]
    # (instances summed together, or that do not come back: no instance whole ends the job)
    plain, _, _ = make()
    assert plain.lose(3, "gone", 12) and not plain.lose(1, "gone", 13)
    gone, _, _ = make(bring_back=False, alone=True)
    assert gone.lose(3, "gone", 12) and not gone.lose(1, "gone", 13)
