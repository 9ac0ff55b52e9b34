"""A lost virtual worker re-formed from its surviving devices and free ones
(``pipeline/vw_reform.py``): survivors kept, as few free devices added as hold the model (the
most memory first), memory respected, a clear reason when nothing holds it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.cluster.spec import ClusterSpec, DeviceSpec
from flotilla.pipeline.plan import PartitionOptions, PlanError, memory_shortfalls
from flotilla.pipeline.profile import ModelProfile
from flotilla.pipeline.vw_placement import WaveSettings, virtual_worker
from flotilla.pipeline.vw_reform import Reformed, reform

MiB = 2**20
# 6 layers of 1 MiB of parameters: with SGD+momentum (x3) the model needs ~18 MiB and more
PROFILE = ModelProfile.uniform(6, forward_s=0.01, backward_s=0.02, activation_bytes=64 * 1024,
                               param_bytes=MiB, batch_size=8)  # fmt: skip
OPTIONS = PartitionOptions(allow_replication=False)
WAVES = WaveSettings(s_local=1, clock_distance=0)


def _devices(spec: Sequence[tuple[float, int]], prefix: str = "d") -> list[DeviceSpec]:
    """(speed, memory MiB) per device, named d0, d1, ..."""
    return [
        DeviceSpec(name=f"{prefix}{i}", node="n0", type="T", speed=speed, memory_bytes=mem * MiB)
        for i, (speed, mem) in enumerate(spec)
    ]


def _reform(
    survivors: Sequence[DeviceSpec],
    free: Sequence[DeviceSpec],
    others: Sequence[Sequence[DeviceSpec]] = (),
    cluster: ClusterSpec | None = None,
) -> Reformed | str:
    every = (*survivors, *free, *(d for o in others for d in o))
    cluster = cluster or ClusterSpec(devices=every or tuple(_devices([(1.0, 1)], "x")))
    return reform(survivors, free, others, cluster, lambda share: PROFILE, 8, OPTIONS, WAVES)


def _fits(devices: Sequence[DeviceSpec], cluster: ClusterSpec) -> bool:
    if not devices:
        return False
    try:
        virtual_worker(devices, cluster, PROFILE, OPTIONS, WAVES)
    except PlanError:
        return False
    return True


def test_survivors_that_hold_the_model_take_no_free_device() -> None:
    survivors, free = _devices([(1.0, 30), (0.5, 30)]), _devices([(1.0, 40)], "f")
    got = _reform(survivors, free)
    assert isinstance(got, Reformed)
    assert got.added == () and set(got.vw.devices) == {"d0", "d1"}


def test_free_devices_are_added_most_memory_first_until_the_model_fits() -> None:
    survivors = _devices([(1.0, 7)])  # (two of the six layers)
    free = _devices([(1.0, 6), (0.2, 12), (0.9, 12), (1.0, 4)], "f")
    cluster = ClusterSpec(devices=(*survivors, *free))
    got = _reform(survivors, free, cluster=cluster)
    assert isinstance(got, Reformed), got
    assert got.vw.devices[0] == "d0"  # (survivors first: the pipeline follows the order)
    assert got.added == ("f2", "f1")  # 12 MiB each (three layers), the faster first: 2 + 3 + 3 >= 6
    by_name = {d.name: d for d in cluster.devices}
    assert not memory_shortfalls(got.vw.plan, [by_name[n] for n in got.vw.devices])
    assert not _fits([*survivors, by_name["f2"]], cluster)  # (one fewer: not enough)


def test_nothing_that_holds_the_model_is_a_reason_naming_the_devices() -> None:
    survivors, free = _devices([(1.0, 4)]), _devices([(1.0, 4)], "f")
    got = _reform(survivors, free)
    assert isinstance(got, str) and "d0, f0" in got and "fits in memory" in got
    nothing = _reform([], [])
    assert isinstance(nothing, str) and "no device left" in nothing
    with pytest.raises(ValueError, match="once"):
        _reform(survivors, survivors, cluster=ClusterSpec(devices=tuple(survivors)))


def test_a_vw_that_would_pace_the_others_down_takes_faster_devices_or_waits() -> None:
    """Under WSP every VW moves at the slowest one's pace: a slow VW formed again could slow the
    job down; it takes free devices until the job is faster with it than without, or waits."""
    others = [_devices([(1.0, 30), (1.0, 30)], "o")]
    slow = _devices([(0.1, 30)])  # (holds the model alone, at a tenth of the speed)
    got = _reform(slow, [], others)
    assert isinstance(got, str) and "slower with it" in got and "than without" in got
    fast = _devices([(1.0, 30), (1.0, 30)], "f")
    got = _reform(slow, fast, others)
    assert isinstance(got, Reformed), got
    assert got.samples_per_s > got.without_samples_per_s and got.added
    assert got.vw.devices[0] == "d0"


def test_vws_over_their_memory_at_their_larger_share_take_any_vw_that_holds_its_own() -> None:
    """Fewer VWs, larger shares: the VW that trains alone takes the whole batch, more than its
    devices hold; a VW formed again halves its share, so it is taken whatever its pace."""

    def profile_for(share: int) -> ModelProfile:
        return ModelProfile.uniform(6, forward_s=0.01, backward_s=0.02, activation_bytes=share * MiB,
                                    param_bytes=MiB, batch_size=share)  # fmt: skip

    def fits(devices: Sequence[DeviceSpec], share: int) -> bool:
        try:
            virtual_worker(devices, ClusterSpec(devices=tuple(devices)), profile_for(share), OPTIONS, WAVES)
        except PlanError:
            return False
        return True

    # (two devices of a memory that holds a VW at half the batch, 4, and not at all of it, 8)
    mem = next(
        m
        for m in range(10, 200)
        if fits(_devices([(1.0, m)] * 2), 4) and not fits(_devices([(1.0, m)] * 2), 8)
    )
    others = [_devices([(1.0, mem)] * 2, "o")]
    slow = _devices([(0.05, mem), (0.05, mem)])  # (a twentieth of the pace: slower than without it)
    every = (*slow, *others[0])
    got = reform(slow, [], others, ClusterSpec(devices=every), profile_for, 8, OPTIONS, WAVES)
    assert isinstance(got, Reformed), got
    assert got.without_samples_per_s == 0.0 and got.samples_per_s > 0
    # (the VWs that train now fit their share: the pace rule holds as before)
    roomy = [_devices([(1.0, 4 * mem)] * 2, "o")]
    got = reform(slow, [], roomy, ClusterSpec(devices=(*slow, *roomy[0])), profile_for, 8, OPTIONS, WAVES)
    assert isinstance(got, str) and "slower with it" in got


@st.composite
def groups(draw: st.DrawFn) -> tuple[list[DeviceSpec], list[DeviceSpec]]:
    spec = st.tuples(st.sampled_from([0.25, 0.5, 1.0]), st.sampled_from([3, 6, 9, 20]))
    survivors = _devices(draw(st.lists(spec, min_size=0, max_size=3)))
    free = _devices(draw(st.lists(spec, min_size=0, max_size=4)), "f")
    return survivors, free


@given(groups())
@settings(max_examples=60, deadline=None)
def test_a_reformed_vw_keeps_its_survivors_respects_memory_and_adds_no_device_it_does_not_need(
    drawn: tuple[list[DeviceSpec], list[DeviceSpec]],
) -> None:
    survivors, free = drawn
    cluster = ClusterSpec(devices=(*survivors, *free) or tuple(_devices([(1.0, 1)], "x")))
    got = _reform(survivors, free, cluster=cluster)
    by_name = {d.name: d for d in (*survivors, *free)}
    if isinstance(got, str):  # the oracle: not even every device together holds the model
        assert not (survivors or free) or not _fits([*survivors, *free], cluster)
        return
    names = got.vw.devices
    assert len(names) == len(set(names))
    assert names[: len(survivors)] == tuple(d.name for d in survivors)
    assert set(got.added) == set(names[len(survivors) :]) <= {d.name for d in free}
    assert set(got.released) <= set(names)
    assert not memory_shortfalls(got.vw.plan, [by_name[n] for n in names])
    if got.added:  # minimal in its order: without the last device added, the model did not fit
        assert not _fits([by_name[n] for n in names[:-1]], cluster)
