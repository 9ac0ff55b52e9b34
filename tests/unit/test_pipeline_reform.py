"""``launch/pipeline_reform.Reformer``: what it asks the strategy when a lost instance would come
back -- the device of the stage whose own failure lost it counted gone, the instance's other
devices as survivors, the devices no instance holds as free, the training instances as others --
and what it makes of the answer (the job grown on new processes, a wait with its reason, or the
instance's own processes)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flotilla.cluster.spec import ClusterSpec, DeviceSpec
from flotilla.core.errors import FlotillaError
from flotilla.launch.pipeline_reform import Profiles, Reformer
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


def _reformer(plug: Plug, profile_for: Any = lambda share: None) -> Reformer:
    cluster = ClusterSpec(devices=tuple(DeviceSpec(name=n, memory_bytes=5 * MIB) for n in NAMES))
    ctx = PlaceContext(cluster=cluster, profile_for=profile_for, options=None, batch_size=16)
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


def test_a_profile_not_measured_yet_is_measured_off_the_watch_and_the_vw_tried_again_once_in(
    tmp_path: Path,
) -> None:
    """The strategy asks for the model's profile at a new share: measuring it runs the model, on a
    thread of its own -- the try answers ``profiling ...`` (the watch goes on finding deaths), the
    job waits for it (``pending``), and the poll after it is in tries again (``arrivals``)."""
    release, asked = threading.Event(), []

    def profile_for(share: int) -> str:  # (a slow measurement; 8: one measured before, at once)
        asked.append(share)
        if share != 8:
            assert release.wait(30)
        return f"profile@{share}"

    class Profiled(Plug):
        def reform(self, ctx: Any, survivors: tuple, free: tuple, others: tuple) -> Any:
            self.seen = (ctx.profile_for(8), ctx.profile_for(16))  # (VWs that train now: larger shares)
            return super().reform(ctx, survivors, free, others)

    plug = Profiled(("b0", "c0"))
    r = _reformer(plug, profile_for)
    got = r(_job(tmp_path), 1, "b1", (0,))
    assert got == "profiling the model at a share of 16 samples (in the background)", got
    assert r.waiting == {1: got} and r.gone == {"b1"} and r.pending() and not r.arrivals()
    release.set()
    deadline = time.monotonic() + 30
    while r.profiles.busy() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not r.pending() and r.arrivals() and not r.arrivals()  # (in: worth one more try)
    job = r(_job(tmp_path), 1, "b1", (0,))
    assert job.names_of(1) == ("b0~3", "c0~4") and plug.seen == ("profile@8", "profile@16")
    assert sorted(asked) == [8, 16]  # (each share measured once)


def test_a_profile_that_fails_is_the_reason_the_vw_waits() -> None:
    def profile_for(share: int) -> Any:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    profiles = Profiles(profile_for, wait_s=5.0)
    for _ in range(2):  # (measured once: the same answer again)
        with pytest.raises(FlotillaError) as got:
            profiles(4)
        assert str(got.value) == (
            "profiling the model at a share of 4 samples failed: mat1 and mat2 shapes cannot be multiplied"
        )
    assert not profiles.busy()
