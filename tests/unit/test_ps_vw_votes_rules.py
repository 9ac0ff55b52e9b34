"""The vote rule of a virtual worker's parts (``two_phase.vote_verdict``): each part stages on
every shard, then votes on every shard; the stages interleave arbitrarily and any of them may die
at any point.  A shard applies the clock only at its last vote, then with every part (the union
of their chunks); once the VW is declared dead, the resolution (target = the highest committed
clock any shard reports) never finds a half-applied shard and every shard ends at the same clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.ps.clock_rules import Refused
from flotilla.ps.two_phase import NONE, Parts, resolution_target, resolve_verdict, stage_part, vote_verdict


def _run(parts: int, shards: int, order: list[int], deaths: list[int]) -> None:
    entries: list[Parts | None] = [None] * shards
    recorded = [0] * shards
    applied: list[list[frozenset[int]]] = [[] for _ in range(shards)]
    chunks = [[frozenset({10 * p + s}) for s in range(shards)] for p in range(parts)]  # part p, shard s
    steps = [
        [("stage", s) for s in range(shards)] + [("vote", s) for s in range(shards)] for _ in range(parts)
    ]
    done = [0] * parts
    for p in order:
        if done[p] >= min(deaths[p], len(steps[p])):
            continue  # dead, or finished
        what, s = steps[p][done[p]]
        done[p] += 1
        if what == "stage":
            _, entries[s] = stage_part(7, recorded[s], entries[s], 0, p, parts, chunks[p][s], fenced=False)
            continue
        verdict, now = vote_verdict(7, recorded[s], entries[s], 0, p, parts, fenced=False)
        assert verdict != "done"
        if verdict == "apply":
            assert now is not None and now.complete  # every part staged here
            applied[s].append(frozenset().union(*now.chunks.values()))
            entries[s], recorded[s] = None, 1
        else:
            entries[s] = now
    for s in range(shards):
        assert applied[s] in ([], [frozenset().union(*(chunks[p][s] for p in range(parts)))])
        if applied[s]:
            assert all(done[p] >= shards + 1 for p in range(parts))  # every part voted somewhere
    target = resolution_target(recorded)
    for s in range(shards):
        staged = NONE if entries[s] is None else entries[s].staged
        if resolve_verdict(recorded[s], staged, target) == "commit":  # (never half_applied)
            recorded[s] = target
    assert len(set(recorded)) == 1


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_votes_apply_every_part_or_nothing_and_resolve_to_one_clock(data: st.DataObject) -> None:
    parts = data.draw(st.integers(1, 4))
    shards = data.draw(st.integers(1, 3))
    order = data.draw(st.lists(st.integers(0, parts - 1), min_size=0, max_size=parts * shards * 2 + 6))
    order += [p for p in range(parts) for _ in range(2 * shards)]  # (the survivors finish)
    deaths = data.draw(st.lists(st.integers(0, 2 * shards + 1), min_size=parts, max_size=parts))
    _run(parts, shards, order, deaths)


def test_with_nobody_dying_every_shard_applies_once() -> None:
    _run(3, 2, [0, 1, 2] * 4, [99, 99, 99])


def test_a_vote_keeps_across_a_restage_and_an_old_clock_is_done() -> None:
    _, e = stage_part(1, 0, None, 0, 0, 2, frozenset({1}), fenced=False)
    verdict, e = vote_verdict(1, 0, e, 0, 0, 2, fenced=False)
    assert verdict == "wait" and e is not None and e.votes == {0}
    _, e = stage_part(1, 0, e, 0, 0, 2, frozenset({1}), fenced=False)  # part 0 stages again
    _, e = stage_part(1, 0, e, 0, 1, 2, frozenset({2}), fenced=False)
    assert e is not None and e.votes == {0}
    assert vote_verdict(1, 0, e, 0, 1, 2, fenced=False)[0] == "apply"
    assert vote_verdict(1, 1, None, 0, 1, 2, fenced=False) == ("done", None)


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"part": 1}, "not_staged"),  # part 1 never staged
        ({"parts": 3}, "bad_part"),
        ({"part": 2}, "bad_part"),
        ({"clock": 1}, "bad_clock"),
        ({"fenced": True}, "unknown_worker"),
    ],
)
def test_bad_votes_are_refused(kwargs: dict, code: str) -> None:
    _, e = stage_part(1, 0, None, 0, 0, 2, frozenset({1}), fenced=False)
    args = {"clock": 0, "part": 0, "parts": 2, "fenced": False, **kwargs}
    with pytest.raises(Refused) as err:
        vote_verdict(1, 0, e, args["clock"], args["part"], args["parts"], fenced=args["fenced"])
    assert err.value.code == code
