"""``InstanceWatch`` with a lost instance formed again on other processes (``reshape``,
``launch/pipeline_reform.py``) and devices added mid-run (``devices``), with fake processes and a
fake store: the newcomers are the new processes; the exit of an old process of the instance --
its group broke, seen after the return -- changes nothing; an instance that cannot be formed
waits (every instance lost: the attempt goes on only while devices may still be added) and is
tried again when a device arrives."""

from __future__ import annotations

from typing import Any

from flotilla.comm.store import StoreAddress
from flotilla.launch.pipeline_instances import InstanceWatch
from flotilla.pipeline.layout import Layout
from flotilla.pipeline.replicas import Generation, generation_key, ready_key

from ._store import Store
from .test_pipeline_instances import Child, Sup


class Feed:
    def __init__(self) -> None:
        self.arrived, self.more = False, True

    def arrivals(self) -> bool:
        got, self.arrived = self.arrived, False
        return got

    def pending(self) -> bool:
        return self.more


def make(answers: list[Any], budget: int = 2) -> tuple[InstanceWatch, Sup, list, list, Store, Feed]:
    names = ["a0", "b0", "b1"]  # (VW 0: a0; VW 1: b0, b1)
    sup = Sup([Child(n) for n in names])
    spawned: list[tuple[int, int, int]] = []
    asked: list[tuple[int, str | None, tuple[int, ...]]] = []

    def spawn(g: int, join: int, arrival: int) -> Child:
        spawned.append((g, join, arrival))
        child = Child(watch.names[g])
        sup.children.append(child)
        return child

    def reshape(instance: int, lost_by: str | None, live: tuple[int, ...]) -> Any:
        asked.append((instance, lost_by, live))
        got = answers.pop(0)
        if isinstance(got, tuple):  # (the new processes' names)
            layout = watch.layout.reformed(instance, len(got))
            first = len(watch.names)
            return (*watch.names, *(f"{n}~{first + i}" for i, n in enumerate(got))), layout
        return got

    feed = Feed()
    watch = InstanceWatch(
        list(names),
        Layout((1, 2)),
        store=StoreAddress("127.0.0.1", 1),
        spawn=spawn,  # type: ignore[arg-type]
        budget=budget,
        alone=True,
        reshape=reshape,
        devices=feed,
    )
    store = Store()
    watch._client = store
    return watch, sup, spawned, asked, store, feed


def test_a_lost_instance_comes_back_on_new_processes_and_an_old_one_s_late_exit_changes_nothing() -> None:
    watch, sup, spawned, asked, store, _ = make([("b0", "c0")])
    sup.children[2].proc.code = -9  # (b1 killed)
    sup.children[1].proc.code = 1  # (b0 exited too -- its group broke -- held for the grace)
    assert watch.handles(sup, sup.children[2], 10)  # type: ignore[arg-type]
    assert asked == [(1, "b1", (0,))] and watch.names == ["a0", "b0", "b1", "b0~3", "c0~4"]
    assert list(watch.layout.processes(1)) == [3, 4] and spawned == [(3, 3, 1), (4, 3, 1)]
    store.set(ready_key(3, 3), b"1")
    store.set(ready_key(3, 4), b"1")
    watch.poll(sup, 12)  # type: ignore[arg-type]
    assert Generation.from_bytes(store.kv[generation_key(3)]) == Generation(3, (0, 1))
    # (the old b0's exit, seen only now, after the grace: not a loss of the new VW 1)
    assert watch.handles(sup, sup.children[1], 13)  # type: ignore[arg-type]
    assert (
        watch.generation.instances == (0, 1) and len(watch.history.lost) == 1 and watch.out(sup.children[1])
    )


def test_a_loss_nobody_caused_is_asked_with_no_culprit() -> None:
    watch, sup, spawned, asked, _, _ = make([None])
    sup.children[1].proc.code = sup.children[2].proc.code = 1
    assert watch.handles(sup, sup.children[2], 10, nobody_failed=True)  # type: ignore[arg-type]
    assert asked == [(1, None, (0,))] and spawned == [(1, 3, 1), (2, 3, 1)]  # (on its own processes)


def test_an_instance_that_cannot_be_formed_waits_for_a_device_and_keeps_the_job_on_meanwhile() -> None:
    watch, sup, spawned, asked, store, feed = make(
        ["b0 is short", "still short", "short", "short again", ("x0", "x1"), "x1 alone is short", "short"]
    )
    sup.children[2].proc.code = sup.children[1].proc.code = -9  # (b1 killed; b0 as the watch leaves it)
    assert watch.handles(sup, sup.children[2], 10)  # type: ignore[arg-type]
    assert spawned == [] and watch.generation.instances == (0,) and watch.returns.budget == 2
    sup.children[0].proc.code = -9  # (VW 0 lost too: VW 1 asked again, still short)
    assert watch.handles(sup, sup.children[0], 11)  # type: ignore[arg-type]  # (devices may come)
    assert watch.generation.instances == () and asked[1:] == [(1, "b1", ()), (0, "a0", ())] and spawned == []
    watch.poll(sup, 11)  # type: ignore[arg-type]
    assert len(asked) == 3  # (no device arrived: nobody asked)
    feed.arrived = True
    watch.poll(sup, 12)  # type: ignore[arg-type]  # (VW 1 still short; VW 0 formed on x0, x1)
    assert [a[0] for a in asked[3:]] == [1, 0] and spawned == [(3, 4, 1), (4, 4, 1)]
    assert watch.names[3:] == ["x0~3", "x1~4"] and list(watch.layout.processes(0)) == [3, 4]
    feed.more = False  # (no device left to come, and the newcomers fail: the failure path)
    sup.children[-2].proc.code = 1
    sup.children[-1].proc.code = -9
    store.set(ready_key(4, 3), b"1")
    watch.returns.budget = 0  # (a re-form takes none of it: both VWs are asked all the same)
    assert not watch.handles(sup, sup.children[-2], 13)  # type: ignore[arg-type]
    assert asked[-2:] == [(0, "x0~3", ()), (1, "b1", ())] and watch.unable == {
        0: "x1 alone is short",
        1: "short",
    }


def test_a_newcomer_that_fails_on_its_own_counts_its_device_lost_and_none_left_ends_the_wait() -> None:
    watch, sup, spawned, asked, store, feed = make(
        [("b0", "c0"), "c0 was the last", "still", "short"], budget=3
    )
    sup.children[2].proc.code = sup.children[1].proc.code = -9
    assert watch.handles(sup, sup.children[2], 10)  # type: ignore[arg-type]
    assert spawned == [(3, 3, 1), (4, 3, 1)]
    sup.children[-1].proc.code = -9  # (c0~4 revoked before it was in; b0~3 as the watch's kill leaves it)
    sup.children[-2].proc.code = -9
    assert watch.handles(sup, sup.children[-1], 11)  # type: ignore[arg-type]
    assert asked[-1] == (1, "c0~4", (0,)) and watch.unable == {1: "c0 was the last"} and watch.goes_on()
    sup.children[0].proc.code = -9  # (VW 0 lost: none trains; devices may still come)
    assert watch.handles(sup, sup.children[0], 12)  # type: ignore[arg-type]
    assert watch.generation.instances == () and watch.goes_on()
    feed.more = False  # (the schedule has no add left: the supervisor ends the attempt)
    assert not watch.goes_on() and watch.unable == {1: "still", 0: "short"}


def test_a_vw_formed_again_takes_none_of_the_budget() -> None:
    """With ``job.max_restarts`` spent, a VW whose stage failed still comes back formed again on
    other devices (each re-form leaves the failed device out: no crash loop), on its own
    processes it would not (``launch/pipeline_returns.py``)."""
    watch, sup, spawned, asked, _, _ = make([("b0", "c0")], budget=0)
    sup.children[2].proc.code = sup.children[1].proc.code = -9  # (b1 killed; b0 as the watch leaves it)
    assert watch.handles(sup, sup.children[2], 10)  # type: ignore[arg-type]
    assert asked == [(1, "b1", (0,))] and spawned == [(3, 3, 1), (4, 3, 1)] and watch.returns.budget == 0


def test_a_vw_formed_again_whose_newcomer_s_group_broke_comes_back_free_on_the_same_processes() -> None:
    """The return of a VW formed again is given up because a newcomer's group broke (nobody
    failed): it is tried again at once on the same new processes, still taking none of the budget."""
    watch, sup, spawned, asked, _, _ = make([("b0", "c0"), None], budget=0)
    sup.children[2].proc.code = sup.children[1].proc.code = -9  # (b1 killed; b0 as the watch leaves it)
    assert watch.handles(sup, sup.children[2], 10)  # type: ignore[arg-type]
    assert spawned == [(3, 3, 1), (4, 3, 1)]
    sup.children[-1].proc.code = 1  # (c0~4's group broke before it was in: nobody failed)
    sup.children[-2].proc.code = -9  # (b0~3 as the watch's kill leaves it)
    assert watch.handles(sup, sup.children[-1], 11, nobody_failed=True)  # type: ignore[arg-type]
    assert asked[-1] == (1, None, (0,))  # (asked again with no culprit: the same new processes)
    assert spawned[2:] == [(3, 3, 2), (4, 3, 2)] and watch.returns.budget == 0  # (the same generation)
    assert watch.names == ["a0", "b0", "b1", "b0~3", "c0~4"]
