"""A parameter-server job on 2 shards resumes on 3 (issue 36, item 4; ``launch/ps_resume.py``).

BSP with server-side SGD and momentum is deterministic (versioned reads, ordered clocks), and a
chunk's arithmetic does not depend on which shard holds it: 12 clocks on 2 shards, then
``--resume auto`` on 3 shards to clock 24, ends with the same bits as 24 uninterrupted clocks on
2 shards.  The resumed run starts at clock 12 (every worker's records hold clocks 12..23 once),
and keeps the snapshots it resumed from (moved aside to ``ps-snapshots.prev``).  The refusals
(a shard missing, another model, nothing left to train) are ``tests/unit/test_ps_resume_launch.py``'s.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.multiproc._jobs import start

pytestmark = pytest.mark.timeout(300)

CONFIG = """
cluster: {{num_workers: 2}}
job:
  model: {{name: tiny_mlp}}
  dataset: {{name: synthetic, num_samples: 2000}}
  optimizer: {{kind: sgd, lr: 0.05, momentum: 0.9}}
  batch_size: 40
  steps: {steps}
  eval_every_steps: 0
strategy: {{kind: ps, num_servers: {shards}, consistency: {{kind: bsp}}, update: server_sgd}}
"""


def _run(tmp: Path, name: str, steps: int, shards: int, report: Path, extra: list[str], rc: int = 0) -> str:
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(CONFIG.format(steps=steps, shards=shards))
    args = ["run", str(cfg), "--no-progress", "--run-dir", str(tmp / f"run-{name}"), "--report", str(report)]
    log = tmp / f"{name}.log"
    proc = start(args + extra, log)
    assert proc.wait(timeout=240) == rc, log.read_text()[-3000:]
    return log.read_text()


def test_two_shards_resume_as_three_and_end_where_an_uninterrupted_run_does(tmp_path: Path) -> None:
    report = tmp_path / "job"
    _run(tmp_path, "first", 12, 2, report, [])
    first = load_file(report / "model.safetensors")
    before = len((report / "metrics.jsonl").read_text().splitlines())  # (a resumed run appends)
    kept = tmp_path / "kept"
    shutil.copytree(report / "ps-snapshots", kept)
    _run(tmp_path, "resumed", 24, 3, report, ["--resume", "auto"])
    summary = json.loads((report / "summary.json").read_text())
    assert (
        summary["completed"] and summary["resumed"]["clock"] == 12 and summary["resumed"]["num_shards"] == 2
    )
    assert summary["resumed"]["from"].endswith("ps-snapshots.prev")
    assert sorted(p.name for p in (report / "ps-snapshots.prev").iterdir()) == sorted(
        p.name for p in kept.iterdir()
    )
    assert len(list((report / "ps-snapshots").glob("ps-shard-*-of-3.snap"))) == 3
    records = [json.loads(line) for line in (report / "metrics.jsonl").read_text().splitlines()]
    clocks = Counter((r["worker_id"], r["clock"]) for r in records if r.get("committed"))
    assert sorted(clocks) == [(w, c) for w in range(2) for c in range(24)] and set(clocks.values()) == {1}
    assert min(r["clock"] for r in records[before:]) == 12  # (the resumed run's own records)
    straight = tmp_path / "straight"
    _run(tmp_path, "straight", 24, 2, straight, [])
    final, expected = load_file(report / "model.safetensors"), load_file(straight / "model.safetensors")
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(final[key], value), key
    assert any(not torch.equal(first[k], expected[k]) for k in expected)  # (it did train on)
