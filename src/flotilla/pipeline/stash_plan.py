"""Weight-stash decisions of one pipeline stage, read off its action list (pure; SPEC §3.3).

Given a stage's ordered actions (``flotilla.pipeline.schedule``), this module decides -- without
torch -- what the torch ``WeightStash`` (``flotilla.pipeline.stash``) must hold:

- ``plan_stash(actions)``: which microbatches run on a STASHED weight version and which on the
  LIVE parameters, and the index of the last action naming each version.  The passes of
  microbatch b may use the live parameters when no ``OptimizerStep`` of this stage runs between
  the forward and the backward of b and the forward's version is the newest when it runs (always
  so in GPipe and 1F1B); otherwise both passes use the stashed version.  A version may be dropped
  right after its last use (``StashPlan.needed_after``).
- ``peak_in_flight(actions)``: the most microbatches between their Forward and their Backward at
  once (what the runtime may hold; ``validate.analyze`` reports it per stage).
- ``peak_weight_versions(actions)``: the most weight versions that must be alive at once: version
  v lives from the update that creates it until it is superseded or, if later, its last named use.

Invariant (tested): the runtime's stash never holds more copies than ``peak_weight_versions``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from flotilla.core.errors import ConfigError
from flotilla.pipeline.schedule import Action, Backward, Forward, OptimizerStep

__all__ = ["StashPlan", "peak_in_flight", "peak_weight_versions", "plan_stash"]


@dataclass(frozen=True, slots=True)
class StashPlan:
    """``stashed``: microbatches whose passes use a stashed version; ``last_use``: version -> index
    of the last Forward/Backward naming it (-1: never named)."""

    stashed: frozenset[int]
    last_use: Mapping[int, int]

    def needed_after(self, version: int, action_idx: int) -> bool:
        """Whether an action after ``action_idx`` still names ``version``."""
        return self.last_use.get(version, -1) > action_idx

    def is_last_use(self, version: int, action_idx: int) -> bool:
        """Whether the action at ``action_idx`` is the last one naming ``version`` (drop it after)."""
        return self.last_use.get(version) == action_idx


def plan_stash(actions: Sequence[Action]) -> StashPlan:
    """The stash decisions for one stage's action list (see the module docstring)."""
    newest = 0
    forward_at: dict[int, tuple[int, bool]] = {}  # b -> (index, version was newest)
    updates: list[int] = []
    last_use: dict[int, int] = {}
    stashed: set[int] = set()
    for idx, action in enumerate(actions):
        if isinstance(action, OptimizerStep):
            updates.append(idx)
            newest = action.writes_version
        elif isinstance(action, Forward):
            forward_at[action.microbatch_idx] = (idx, action.weight_version == newest)
            last_use[action.weight_version] = idx
        elif isinstance(action, Backward):
            last_use[action.weight_version] = idx
            start = forward_at.get(action.microbatch_idx)
            if start is None:
                raise ConfigError(
                    f"Backward of microbatch {action.microbatch_idx} at action {idx} has no forward"
                )
            f_idx, was_newest = start
            if not was_newest or _update_between(updates, f_idx, idx):
                stashed.add(action.microbatch_idx)
    return StashPlan(stashed=frozenset(stashed), last_use=last_use)


def _update_between(updates: list[int], lo: int, hi: int) -> bool:
    """Whether some update index u satisfies lo < u < hi (``updates`` is sorted)."""
    pos = bisect_right(updates, lo)
    return pos < len(updates) and updates[pos] < hi


def peak_in_flight(actions: Iterable[Action]) -> int:
    """Most microbatches between their Forward and their Backward at once."""
    live = peak = 0
    for action in actions:
        live += isinstance(action, Forward) - isinstance(action, Backward)
        peak = max(peak, live)
    return peak


def peak_weight_versions(actions: Sequence[Action]) -> int:
    """Version v lives on positions [created_v, max(created_{v+1}, last_use_v + 1)); the most
    versions alive at one position."""
    created = {0: 0}
    last_use: dict[int, int] = {}
    for idx, action in enumerate(actions):
        if isinstance(action, OptimizerStep):
            created[action.writes_version] = idx
        elif isinstance(action, (Forward, Backward)):
            last_use[action.weight_version] = idx
    ends = {v: max(created.get(v + 1, len(actions) + 1), last_use.get(v, -1) + 1) for v in created}
    return max(
        (sum(1 for v in created if created[v] <= t < ends[v]) for t in range(len(actions) + 1)),
        default=1,
    )
