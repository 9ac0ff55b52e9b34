"""A one-instance pipeline's stage group re-forming after the network broke it
(``roles/stage_parts.StageMembership.recover`` with a ``regroup``), with fake groups: each try
moves to the next epoch; a re-forming that breaks too tries the next one (a bounded number of
times); a group that does not form (a stage is gone) ends the run at once; without ``regroup`` a
broken group ends the run as before."""

from __future__ import annotations

import pytest

from flotilla.core.errors import CollectiveError
from flotilla.roles.stage_membership import MAX_REGROUPS, StageGroupBroke, StageMembership


class FakeGroup:
    def __init__(self, namespace: str) -> None:
        self.namespace, self.closed = namespace, False

    def close(self) -> None:
        self.closed = True


def membership(fail_build_at: int | None = None) -> tuple[StageMembership, list[FakeGroup]]:
    made: list[FakeGroup] = []

    def make_group(view, tag):
        if view.epoch == fail_build_at:
            raise CollectiveError(f"epoch {view.epoch}: group rendezvous failed: a member never came")
        made.append(FakeGroup(f"pp/0/epoch/{view.epoch}{tag}/"))
        return made[-1]

    return StageMembership(0, 2, make_group), made


def test_a_broken_group_re_forms_in_the_next_epoch_and_a_re_forming_that_breaks_tries_the_next() -> None:
    m, made = membership()
    m.group(m.view)
    seen: list[int] = []

    def regroup(epoch: int, group) -> None:
        seen.append(epoch)
        if epoch == 2:
            raise CollectiveError("reset again inside the step agreement")

    m.regroup = regroup
    view = m.recover(frozenset())
    assert view is not None and view.epoch == 3 and seen == [2, 3]
    assert [g.namespace for g in made] == ["pp/0/epoch/1/", "pp/0/epoch/2/", "pp/0/epoch/3/"]
    assert made[0].closed and made[1].closed and not made[2].closed


def test_a_group_that_never_forms_ends_the_run_at_once_and_endless_breaks_are_bounded() -> None:
    m, _ = membership(fail_build_at=2)
    m.regroup = lambda epoch, group: None
    with pytest.raises(StageGroupBroke, match="epoch 2 did not form"):
        m.recover(frozenset())
    m, made = membership()

    def always(epoch: int, group) -> None:
        raise CollectiveError("reset")

    m.regroup = always
    with pytest.raises(StageGroupBroke, match=f"did not re-form in {MAX_REGROUPS} epochs"):
        m.recover(frozenset())
    assert len(made) == MAX_REGROUPS and all(g.closed for g in made)


def test_without_regroup_a_broken_group_ends_the_run() -> None:
    m, _ = membership()
    with pytest.raises(StageGroupBroke, match="this stage stops with its pipeline"):
        m.recover(frozenset())
