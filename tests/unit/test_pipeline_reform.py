"""``launch/pipeline_reform.Reformer``: what it asks the strategy when a lost instance would come
back -- the device of the stage whose own failure lost it counted gone, the instance's other
devices as survivors, the devices no instance holds as free, the training instances as others --
and what it makes of the answer (the job grown on new processes, a wait with its reason, or the
instance's own processes)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from flotilla.cluster.spec import ClusterSpec, DeviceSpec
from flotilla.launch.pipeline_reform import Reformer
from flotilla.sync.stage_plug import PlaceContext, PlannedInstance
from flotilla.trainer.pipeline_job import StageJob

MIB = 1 << 20
NAMES = ("a0", "b0", "b1", "c0", "d0")


class Plug:
    """Answers ``answers`` in turn (a tuple of devices: that VW, cut in two; else as given)."""

    def __init__(self, *answers: Any) -> None:
        self.answers, self.asked = list(answers), []

    def reform(self, ctx: Any, survivors: tuple, free: tuple, others: tuple) -> Any:
        self.asked.append((survivors, free, others))
        got = self.answers.pop(0)
        if not isinstance(got, tuple):
            return got
        stages = [SimpleNamespace(layer_end=e) for e in ((3, 6) if len(got) == 2 else (6,))]
        return PlannedInstance(devices=got, plan=SimpleNamespace(stages=stages))


def _reformer(plug: Plug) -> Reformer:
    cluster = ClusterSpec(devices=tuple(DeviceSpec(name=n, memory_bytes=5 * MIB) for n in NAMES))
    ctx = PlaceContext(cluster=cluster, profile_for=lambda share: None, options=None, batch_size=16)
    speeds = {"a0": 1.0, "b0": 0.5, "b1": 0.5, "c0": 0.25, "d0": 0.2}
    return Reformer(
        plug, ctx, lambda n: SimpleNamespace(speed=speeds.get(n, 0.75), type="N", node="x", memory_bytes=MIB)
    )


def _job(tmp_path: Path) -> StageJob:  # VW 0: a0; VW 1: b0, b1 (c0, d0 unused)
    return StageJob(
        config={}, store_host="h", store_port=1, layer_ends=(6,), stage_names=("a0", "b0", "b1"),
        speeds=(1.0, 0.5, 0.5), total_steps=10, run_dir=tmp_path, replicas=2, instance_ends=((6,), (3, 6)),
    )  # fmt: skip


def test_a_vw_formed_again_gets_new_processes_and_its_lost_device_stays_gone(tmp_path: Path) -> None:
    plug = Plug(("b0", "c0"), ("c0", "d0"))
    r = _reformer(plug)
    job = r(_job(tmp_path), 1, "b1", (0,))
    assert plug.asked == [(("b0",), ("c0", "d0"), (("a0",),))]
    assert job.names_of(1) == ("b0~3", "c0~4") and job.speeds[3:] == (0.5, 0.25) and job.ends_of(1) == (3, 6)
    assert r.gone == {"b1"} and r.formed[1].devices == ("b0", "c0") and r.waiting == {}
    assert r.records == [
        {"instance": 1, "gone": "b1", "devices": ["b0", "c0"], "processes": [3, 4], "layer_ends": [3, 6]}
    ]
    # lost again (b0~3 killed): b1 and b0 gone, c0 survives, d0 is free; a0 holds VW 0
    again = r(job, 1, "b0~3", (0,))
    assert plug.asked[-1] == (("c0",), ("d0",), (("a0",),))
    assert again.names_of(1) == ("c0~5", "d0~6") and r.gone == {"b1", "b0"} and len(r.records) == 2


def test_a_vw_nobody_failed_or_its_strategy_does_not_reform_comes_back_as_it_was(tmp_path: Path) -> None:
    plug = Plug(None)
    r = _reformer(plug)
    assert r(_job(tmp_path), 1, None, (0,)) is None and plug.asked == []  # (its group broke: nobody failed)
    assert r(_job(tmp_path), 1, "b1", (0,)) is None and r.gone == set()  # (the strategy does not re-form)


def test_a_vw_no_group_can_hold_waits_with_the_reason_and_a_lost_vw_reserves_its_devices(
    tmp_path: Path,
) -> None:
    plug = Plug("b0 is short by 1.6 MiB", "still short")
    r = _reformer(plug)
    assert r(_job(tmp_path), 1, "b1", (0,)) == "b0 is short by 1.6 MiB"
    assert r.gone == {"b1"} and r.waiting == {1: "b0 is short by 1.6 MiB"} and r.records == []
    # VW 0 lost too, while VW 1 waits: VW 1's devices are not free for it (b0 survives in VW 1)
    assert r(_job(tmp_path), 0, "a0", ()) == "still short"
    assert plug.asked[-1] == ((), ("c0", "d0"), ())
    r.reset()
    assert r.gone == set() and r.waiting == {} and r.formed == {}


def test_devices_added_mid_run_are_free_for_the_next_try(tmp_path: Path) -> None:
    plug = Plug("b0 is short", ("b0", "n9"))
    r = _reformer(plug)
    assert r(_job(tmp_path), 1, "b1", (0,)) == "b0 is short" and not r.arrivals()
    r.arrive("b1")  # (the revoked device back)
    r.arrive("n9")  # (a new one: the cluster's defaults)
    assert r.arrivals() and not r.arrivals() and r.gone == set()
    assert [d.name for d in r.ctx.cluster.devices][-1] == "n9" and r.ctx.cluster.device("n9").speed == 0.75
    job = r(_job(tmp_path), 1, "b1", (0,))  # (the same loss: b1, added back, is a survivor again)
    assert plug.asked[-1] == (("b0", "b1"), ("c0", "d0", "n9"), (("a0",),))
    assert job.names_of(1) == ("b0~3", "n9~4") and job.speeds[4] == 0.75


def test_a_device_revoked_while_idle_is_not_free_and_a_planning_error_is_a_reason(tmp_path: Path) -> None:
    class Raising(Plug):
        def reform(self, ctx: Any, survivors: tuple, free: tuple, others: tuple) -> Any:
            super().reform(ctx, survivors, free, others)
            raise ValueError("a VW that trains now cannot be planned: short by 1 MiB")

    plug = Raising(None)
    r = _reformer(plug)
    r.revoke("c0")  # (a kill of a device no stage runs on)
    assert not r.arrivals() and r.gone == {"c0"}
    got = r(_job(tmp_path), 1, "b1", (0,))
    assert plug.asked == [(("b0",), ("d0",), (("a0",),))]
    assert isinstance(got, str) and "could not be planned" in got and "short by 1 MiB" in got
    assert r.gone == {"c0", "b1"} and r.waiting[1] == got
