"""``flotilla run``'s side of losing a pipeline instance and bringing it back
(``launch/pipeline_instances.InstanceWatch``) with fake processes and a fake store: a loss spawns
the instance's newcomers for the next generation (while the budget lasts); a newcomer that exits
before it is in cancels the return, forgets its readiness and tells ``on_lost`` (what it took --
e.g. a hetpipe VW's new worker id on the servers -- is released); once every newcomer said it is
ready the generation is announced; a return tried again is a new arrival (a VW's worker id on the
servers is never taken twice)."""

from __future__ import annotations

from dataclasses import dataclass, field

from flotilla.comm.store import StoreAddress
from flotilla.launch.pipeline_instances import InstanceWatch
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

from ._store import Store


@dataclass
class Proc:
    code: int | None = None  # (None: running)

    @property
    def pid(self) -> int:  # (kill_all signals a live process's group: never a fake one's)
        raise AssertionError("a fake process was about to be signalled: exit it first")

    def poll(self) -> int | None:
        return self.code

    def wait(self, timeout: float | None = None) -> int | None:
        return self.code


@dataclass
class Child:
    name: str
    proc: Proc = field(default_factory=Proc)
    role: str = "stage"

    @property
    def returncode(self) -> int | None:
        return self.proc.code


@dataclass
class Sup:
    children: list[Child]

    def alive(self, role: str) -> list[Child]:
        return [c for c in self.children if c.proc.code is None]


def make(
    budget: int, *, alone: bool = False
) -> tuple[InstanceWatch, Sup, list[tuple[int, int, int]], list[tuple[int, int]], Store]:
    names = ["a0", "a1", "b0", "b1"]
    sup = Sup([Child(n) for n in names])
    spawned: list[tuple[int, int, int]] = []
    lost: list[tuple[int, int]] = []  # (instance, its last return's arrival)

    def spawn(g: int, join: int, arrival: int) -> Child:
        spawned.append((g, join, arrival))
        child = Child(names[g])
        sup.children.append(child)
        return child

    watch = InstanceWatch(
        names,
        Layout.uniform(2, 2),
        store=StoreAddress("127.0.0.1", 1),  # (never dialled: the fake store below is the client)
        spawn=spawn,  # type: ignore[arg-type]
        on_lost=lambda instance, arrival: lost.append((instance, arrival)),
        budget=budget,
        alone=alone,
    )
    store = Store()
    watch._client = store
    return watch, sup, spawned, lost, store


def test_a_lost_instance_comes_back_once_its_newcomers_are_ready() -> None:
    watch, sup, spawned, lost, store = make(budget=1)
    sup.children[3].proc.code = -9  # (b1 SIGKILLed; b0, its mate, is killed by the watch)
    sup.children[2].proc.code = -9
    assert watch.handles(sup, sup.children[3], 10)  # type: ignore[arg-type]
    assert lost == [(1, 0)] and watch.generation == Generation(2, (0,))
    assert spawned == [(2, 3, 1), (3, 3, 1)]
    assert [e["instance"] for e in watch.history.lost] == [1]
    watch.poll(sup, 11)  # type: ignore[arg-type]
    assert generation_key(3) not in store.kv  # (nobody ready yet)
    store.set(ready_key(3, 2), b"1")
    store.set(ready_key(3, 3), b"1")
    watch.poll(sup, 12)  # type: ignore[arg-type]
    assert Generation.from_bytes(store.kv[generation_key(3)]) == Generation(3, (0, 1))
    assert [e["instance"] for e in watch.history.returned] == [1] and lost == [(1, 0)]


def test_a_newcomer_that_exits_before_it_is_in_cancels_the_return_and_is_told_as_lost() -> None:
    watch, sup, spawned, lost, store = make(budget=1)
    sup.children[3].proc.code = sup.children[2].proc.code = -9
    assert watch.handles(sup, sup.children[3], 10)  # type: ignore[arg-type]
    newcomer = sup.children[-2]  # (b0's newcomer)
    store.set(ready_key(3, 2), b"1")  # (it said it was ready, then failed)
    newcomer.proc.code = 1
    sup.children[-1].proc.code = -9  # (its mate, as the watch's kill leaves it)
    assert watch.handles(sup, newcomer, 11)  # type: ignore[arg-type]
    # (what the newcomers took is released: e.g. hetpipe's new worker id, barred by its arrival)
    assert lost == [(1, 0), (1, 1)]
    assert ready_key(3, 2) not in store.kv and generation_key(3) not in store.kv
    assert watch.generation == Generation(2, (0,)) and watch.history.returned == []
    assert spawned == [(2, 3, 1), (3, 3, 1)]  # (the budget is spent: not tried again)
    assert watch.out(sup.children[-1])  # type: ignore[arg-type]  # (its mate was retired with it)


def test_a_return_tried_again_joins_the_same_generation_as_a_new_arrival() -> None:
    from flotilla.sync.hetpipe_stage import worker_id_of

    watch, sup, spawned, lost, store = make(budget=2)
    sup.children[3].proc.code = sup.children[2].proc.code = -9
    assert watch.handles(sup, sup.children[3], 10)  # type: ignore[arg-type]
    first_plan = Generation.from_bytes(store.kv[plan_key(3)])
    newcomer = sup.children[-2]
    newcomer.proc.code = 1  # (it failed before it was in: the return is cancelled, tried again)
    sup.children[-1].proc.code = -9
    assert watch.handles(sup, newcomer, 11)  # type: ignore[arg-type]
    assert lost == [(1, 0), (1, 1)] and watch.history.arrivals == 2
    # (the same generation is planned again -- nobody moved -- but as arrival 2, not 1)
    assert spawned == [(2, 3, 1), (3, 3, 1), (2, 3, 2), (3, 3, 2)]
    ids = [worker_id_of(1, arrival, 2) for _g, _join, arrival in spawned]
    assert ids == [3, 3, 5, 5]  # (every stage of a round agrees; the retry's id is a new one)
    # (the plan of the same number under a new serial: its groups meet in namespaces the given-up
    # newcomers never wrote their rendezvous keys in)
    second_plan = Generation.from_bytes(store.kv[plan_key(3)])
    assert second_plan == first_plan and second_plan.tag and second_plan.tag != first_plan.tag
    store.set(ready_key(3, 2), b"1")
    store.set(ready_key(3, 3), b"1")
    watch.poll(sup, 12)  # type: ignore[arg-type]
    announced = Generation.from_bytes(store.kv[generation_key(3)])
    assert announced == Generation(3, (0, 1)) and announced.serial == second_plan.serial


def test_regroup_watch_waits_out_the_grace_for_a_loss_and_starts_again_per_generation() -> None:
    w = RegroupWatch(grace_s=1.0)
    assert not w.due(1, False, 0.0)
    assert not w.due(1, True, 10.0) and not w.due(1, True, 10.9) and w.due(1, True, 11.0)
    assert not w.due(2, True, 11.5) and w.due(2, True, 12.5)  # (a new generation: a new grace)


def test_a_broken_group_with_nobody_lost_regroups_and_a_planned_return_is_tried_again_after() -> None:
    watch, sup, spawned, lost, store = make(budget=1)
    watch._regroups = RegroupWatch(grace_s=0.0)
    store.set(broken_key(1), b"1")
    watch.poll(sup, 3)  # type: ignore[arg-type]
    assert Generation.from_bytes(store.kv[generation_key(2)]) == Generation(2, (0, 1))
    assert watch.generation == Generation(2, (0, 1)) and lost == [] and spawned == []
    assert [e["generation"] for e in watch.history.regrouped] == [2]
    # a loss, its return planned (generation 4), then a group of generation 3 breaks with nobody lost
    sup.children[3].proc.code = sup.children[2].proc.code = -9
    assert watch.handles(sup, sup.children[3], 10)  # type: ignore[arg-type]
    assert watch.generation == Generation(3, (0,)) and spawned == [(2, 4, 1), (3, 4, 1)]
    store.set(broken_key(3), b"1")
    for c in sup.children[-2:]:
        c.proc.code = -9  # (as the watch's kill of the cancelled newcomers leaves them)
    watch.poll(sup, 11)  # type: ignore[arg-type]
    assert Generation.from_bytes(store.kv[generation_key(4)]) == Generation(4, (0,))
    # (the return is planned again after it, as a new arrival; its budget was not spent)
    assert spawned[2:] == [(2, 5, 2), (3, 5, 2)] and Generation.from_bytes(
        store.kv[plan_key(5)]
    ).instances == (0, 1)


def test_a_broken_group_while_a_return_is_ready_lets_the_return_re_form_everyone() -> None:
    watch, sup, spawned, lost, store = make(budget=1)
    watch._regroups = RegroupWatch(grace_s=0.0)
    sup.children[3].proc.code = sup.children[2].proc.code = -9
    assert watch.handles(sup, sup.children[3], 10)  # type: ignore[arg-type]
    store.set(ready_key(3, 2), b"1")
    store.set(ready_key(3, 3), b"1")  # (the newcomers are ready) ... and a group of generation 2 broke
    store.set(broken_key(2), b"1")
    watch.poll(sup, 11)  # type: ignore[arg-type]
    # (no regroup: the plan is announced -- every survivor is in it, so everyone re-forms in it)
    assert Generation.from_bytes(store.kv[generation_key(3)]) == Generation(3, (0, 1))
    assert watch.history.regrouped == [] and spawned == [(2, 3, 1), (3, 3, 1)] and lost == [(1, 0)]


def test_a_loss_nobody_caused_comes_back_without_taking_the_budget() -> None:
    from flotilla.launch.pipeline_returns import FREE_RETURNS

    watch, sup, spawned, lost, store = make(budget=0)
    sup.children[3].proc.code = 1  # (b1 exited: its group broke under it, its mate had not failed)
    sup.children[2].proc.code = -9  # (b0, as the watch's kill leaves it)
    assert watch.handles(sup, sup.children[3], 10, nobody_failed=True)  # type: ignore[arg-type]
    assert spawned == [(2, 3, 1), (3, 3, 1)] and watch.returns.budget == 0 and watch.history.free_returns == 1
    assert watch.history.lost[-1]["nobody_failed"] is True
    # (a loss someone caused -- a stage's own error, a kill -- still needs the budget: none left)
    watch2, sup2, spawned2, _, _ = make(budget=0)
    sup2.children[3].proc.code = sup2.children[2].proc.code = -9
    assert watch2.handles(sup2, sup2.children[3], 10)  # type: ignore[arg-type]
    assert spawned2 == [] and watch2.history.free_returns == 0
    # (free returns are bounded: past FREE_RETURNS in a job they take the budget like any other)
    watch3, sup3, spawned3, _, _ = make(budget=0)
    watch3.history.free_returns = FREE_RETURNS
    sup3.children[3].proc.code = 1
    sup3.children[2].proc.code = -9
    assert watch3.handles(sup3, sup3.children[3], 10, nobody_failed=True)  # type: ignore[arg-type]
    assert spawned3 == []


def _kill(sup: Sup, *indices: int) -> None:
    for g in indices:
        sup.children[g].proc.code = -9


def test_instances_that_stand_alone_all_lost_wait_for_a_return_that_is_not_charged_twice() -> None:
    """HetPipe's VWs (state on the servers): VW 1 lost, its return planned; VW 0 lost meanwhile --
    a generation of none, the planned return cancelled (its budget given back) and tried again
    first, VW 0's after it; each comes back as the only one of its generation's plan."""
    watch, sup, spawned, lost, store = make(budget=2, alone=True)
    _kill(sup, 2, 3)
    assert watch.handles(sup, sup.children[3], 10)  # type: ignore[arg-type]
    assert (
        watch.generation == Generation(2, (0,))
        and spawned == [(2, 3, 1), (3, 3, 1)]
        and watch.returns.budget == 1
    )
    _kill(sup, 0, 1, 4, 5)  # (a1 killed; a0 and VW 1's newcomers as the watch's kill leaves them)
    assert watch.handles(sup, sup.children[1], 11)  # type: ignore[arg-type]
    assert watch.generation == Generation(3, ()) and lost == [(1, 0), (1, 1), (0, 0)]
    assert watch.history.lost[-1]["survivors"] == []
    assert (
        spawned[2:] == [(2, 4, 2), (3, 4, 2)] and watch.returns.budget == 1
    )  # (the return refunded, tried again)
    assert Generation.from_bytes(store.kv[plan_key(4)]).instances == (1,)
    store.set(ready_key(4, 2), b"1")
    store.set(ready_key(4, 3), b"1")
    assert not watch.trains()  # (none: the attempt is not over)
    watch.poll(sup, 12)  # type: ignore[arg-type]
    assert watch.generation == Generation(4, (1,)) and watch.lead == 1
    assert spawned[4:] == [(0, 5, 3), (1, 5, 3)] and watch.returns.budget == 0  # (then VW 0's)
    assert not watch.trains()  # (only the instance coming back, its newcomers not in yet)
    store.set(joined_key(4, 2), b"1")
    store.set(joined_key(4, 3), b"1")
    # (VW 1 in: the newcomers still waiting are VW 0's, coming back next)
    assert [c.name for c in watch.waiting_newcomers()] == ["a0", "a1"] and watch.trains()
    assert Generation.from_bytes(store.kv[plan_key(5)]).instances == (0, 1)


def test_instances_that_stand_alone_all_lost_with_no_return_left_fail_as_before() -> None:
    watch, sup, spawned, _, _ = make(budget=0, alone=True)
    _kill(sup, 2, 3)
    assert watch.handles(sup, sup.children[3], 10)  # type: ignore[arg-type]
    _kill(sup, 0, 1)
    assert not watch.handles(sup, sup.children[1], 11)  # type: ignore[arg-type]  # (the failure path)
    assert watch.generation == Generation(2, (0,)) and spawned == []
    # (instances summed together -- a plain pipeline's replicas -- never wait with none: state lost)
    watch2, sup2, spawned2, _, _ = make(budget=2)
    _kill(sup2, 2, 3)
    assert watch2.handles(sup2, sup2.children[3], 10)  # type: ignore[arg-type]
    _kill(sup2, 0, 1, 4, 5)
    assert not watch2.handles(sup2, sup2.children[1], 11)  # type: ignore[arg-type]


def test_a_newcomer_failing_while_none_trains_and_no_return_is_left_is_the_failure_path() -> None:
    watch, sup, spawned, _, _ = make(budget=1, alone=True)
    watch.history.free_returns = 0
    _kill(sup, 2, 3)
    assert watch.handles(sup, sup.children[3], 10, nobody_failed=True)  # type: ignore[arg-type]  # (free)
    _kill(sup, 0, 1, 4, 5)
    assert watch.handles(sup, sup.children[1], 11)  # type: ignore[arg-type]
    assert watch.generation.instances == () and spawned[2:] == [(2, 4, 2), (3, 4, 2)]
    sup.children[-2].proc.code = 1  # (VW 1's newcomer fails before it is in: the budget pays its retry)
    sup.children[-1].proc.code = -9
    assert watch.handles(sup, sup.children[-2], 12)  # type: ignore[arg-type]
    assert spawned[4:] == [(2, 4, 3), (3, 4, 3)] and watch.returns.budget == 0
    sup.children[-2].proc.code = 1  # (and fails again: nothing can come back now)
    sup.children[-1].proc.code = -9
    assert not watch.handles(sup, sup.children[-2], 13)  # type: ignore[arg-type]
