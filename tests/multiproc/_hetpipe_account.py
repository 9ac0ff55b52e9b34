"""The data account of a ``hetpipe`` run, recomputed from its records and summary: every slice of
every step's global batch was trained by exactly one virtual worker (VW) or is listed as dropped
(``ps/data_views.py``: the slices of an evicted VW between the wave it was removed at and the
start of the view without it).  A killed VW's last records can die with it: its waves before the
one it was removed at (the first of its dropped range) were applied on the shards, so its slices
of them count as trained.  A VW that came back holds another worker id in the later views
(``id % VWs`` is the VW: ``sync/hetpipe_stage.worker_id_of``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flotilla.data.sampler import shard_bounds


def check_account(
    summary: dict[str, Any], report: Path, *, steps: int, batch: int, wave: int
) -> dict[str, int]:
    """Assert the account (module doc); returns ``{"trained": samples, "dropped": samples}``."""
    views = sorted(
        (int(start), [int(m) for m in members]) for start, members in summary["data_views"]["views"]
    )
    dropped = [(int(w), int(a), int(b)) for w, a, b, _why in summary["data_views"]["dropped"]]
    assert views, summary["data_views"]
    vws = summary["replicas"]
    last = _last_stages(summary, vws)
    trained: dict[tuple[int, int], int] = {}  # (vw, step) -> samples its last stage trained
    for line in (report / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line) if line else {}
        if rec.get("loss") is None or "stage_idx" not in rec:
            continue
        vw = int(rec.get("replica", 0))
        if rec["stage_idx"] in last[vw]:
            key = (vw, int(rec["step"]) - 1)
            assert key not in trained, f"VW {vw} recorded step {key[1]} twice"
            trained[key] = int(rec["samples"])
    removed = {w: a for w, a, _b in dropped}
    out = {"trained": 0, "dropped": 0}
    for step in range(steps):
        c = step // wave
        members = next((m for start, m in reversed(views) if start <= c), list(range(vws)))
        for w in members:  # (a worker id: its VW is w % vws -- w itself, or the id it came back as)
            vw = w % vws
            lo, hi = shard_bounds(batch, members.index(w), len(members))
            if any(d == w and a <= c < b for d, a, b in dropped):
                out["dropped"] += hi - lo
                continue
            if (vw, step) not in trained and c < removed.get(w, -1):
                out["trained"] += hi - lo  # (applied: its record died with its process)
                continue
            assert trained.get((vw, step)) == hi - lo, (
                f"step {step} (wave {c}, view {members}): VW {vw} (worker {w}) trained "
                f"{trained.get((vw, step))}, its slice is {hi - lo}"
            )
            out["trained"] += hi - lo
        for vw in range(vws):  # a VW with no id in the view trained nothing it pushed
            if not any(w % vws == vw for w in members) and (vw, step) in trained:
                assert any(d % vws == vw and c >= a for d, a, _b in dropped), (vw, step)  # (never pushed)
    assert out["trained"] + out["dropped"] == steps * batch, out
    return out


def _last_stages(summary: dict[str, Any], vws: int) -> dict[int, set[int]]:
    """Each VW's last stage (the one that records losses), in every form it took: placed, and
    formed again on other devices (``instances_reformed``: maybe with another stage count)."""
    placement = summary.get("placement")
    if placement:
        last = {k: {len(v["layer_ends"]) - 1} for k, v in enumerate(placement["vws"])}
    else:
        last = {k: {len(summary["layer_ends"]) - 1} for k in range(vws)}
    for formed in summary.get("instances_reformed", []):
        last[int(formed["instance"])].add(len(formed["layer_ends"]) - 1)
    return last
