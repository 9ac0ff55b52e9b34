"""Where an announced switch takes effect (``cluster/switch_announce.py``) and the coordinator's
announcer (``roles/coordinator_switch.py``): past every live worker's reach, in order, refused
when no step is left."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flotilla.cluster.switch_announce import Progress, SwitchRefused, announce_step
from flotilla.core.errors import RemoteError
from flotilla.roles.coordinator_switch import MAX_SWITCHES, SwitchAnnouncer

progress = st.builds(Progress, st.integers(0, 10_000), st.floats(0, 500, allow_nan=False))


@given(live=st.dictionaries(st.integers(0, 50), progress, min_size=1, max_size=20), lead=st.floats(0, 10))
def test_the_step_is_past_every_workers_reach(live, lead) -> None:
    step = announce_step(live, lead_s=lead, total_steps=None)
    for p in live.values():
        assert step > p.step + p.steps_per_s * lead  # (it gets there after the news reaches it)
        assert step >= p.step + 2


def test_refused_when_the_job_ends_first_or_nobody_trains() -> None:
    with pytest.raises(SwitchRefused, match="too late to switch"):
        announce_step({0: Progress(7, 3.0)}, lead_s=1.0, total_steps=10)
    assert announce_step({0: Progress(7, 1.0)}, lead_s=1.0, total_steps=10) == 9
    with pytest.raises(SwitchRefused, match="no live worker"):
        announce_step({}, lead_s=1.0, total_steps=10)
    with pytest.raises(ValueError, match="lead_s >= 0"):
        announce_step({0: Progress(1)}, lead_s=-1.0, total_steps=10)


def _req(**body):
    return SimpleNamespace(body=body)


def test_the_announcer_keeps_order_and_refuses_cleanly() -> None:
    live = {0: Progress(7, 4.0), 1: Progress(3, 0.0)}
    a = SwitchAnnouncer(total_steps=100, lead_s=1.0, live=lambda: live)
    assert a.announce(1) == 7 + 4 + 1
    assert a.announce(2) == 13  # (a later announcement takes effect later)
    assert a._on_switch(_req(option=1, not_before=50)) == {"step": 50}
    assert a.announced() == [[12, 1], [13, 2], [50, 1]]
    late = SwitchAnnouncer(total_steps=10, lead_s=1.0, live=lambda: live)
    with pytest.raises(RemoteError, match="switch_refused"):
        late._on_switch(_req(option=1, not_before=None))
    with pytest.raises(SwitchRefused, match=">= 1"):
        late.announce(0)
    assert late.announced() == []  # (nothing changed)
    full = SwitchAnnouncer(total_steps=None, lead_s=0.0, live=lambda: live)
    for _ in range(MAX_SWITCHES):
        full.announce(1)
    with pytest.raises(SwitchRefused, match=f"at most {MAX_SWITCHES}"):
        full.announce(1)
    assert len(full.announced()) == MAX_SWITCHES


def test_a_worker_takes_only_well_formed_announcements() -> None:
    from flotilla.roles.link import _switches

    assert _switches([[3, 1], [5, 2]]) == ((3, 1), (5, 2))
    assert _switches(()) == ()
    for bad in (
        [[3, 1], [-1, 2]],
        [[5, 0]],
        [[3, 1], ["x", 1]],
        "nonsense",
        "12",
        b"ab",
        [[3.9, 1]],
        [[float("inf"), 1]],
        [[True, 1]],
        [[3, 1, 2]],
        [[i, 1] for i in range(100)],
        None,
        7,
    ):
        assert _switches(bad) == (), bad  # (ignored whole, never raised)
