"""The network resets collective-plane connections under ``flotilla run`` (``comm/faulty.py``,
``collective_reset``: a group fails as a launch, its members all alive) -- the data-parallel
strategies must tell that from a death and train on, nothing lost and nothing applied twice:

- ``allreduce`` (3 workers): the job completes with every worker, every step is committed once
  per worker, every committed step's digests agree, and the resets really happened (the workers'
  logs say so; the membership moved to new views);
- ``partial_reduce``: the job completes with every worker, each step once per worker, and some
  groups failed (``pr_committed`` false) without anyone being taken for dead.

- a pipeline (one instance, 1F1B): each stage whose group broke moves to the next epoch's group
  and meets the others there, the broken step is redone -- no restart, and the run trains
  bitwise what the same run without resets trains (the losses, the exported weights), its
  stages' messages to the host lost, repeated, reordered and delayed on the way too.

- two pipeline instances (``replicas: 2``): a stage that finds its group broken and no loss
  announced says so in the store; the launcher, having seen no process exit within the grace,
  announces the same instances as the next generation and every stage re-forms as after a loss
  (new groups, the state agreed, the broken step redone): no instance lost, no restart, the
  clean run's losses.

``hetpipe`` still takes a broken VW group for a lost VW: ``docs/messaging.md``, "Faults on the
collective plane".
"""

from __future__ import annotations

import json
import logging
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

import pytest

from flotilla.comm.faulty import ENV_VAR, NetFaults
from flotilla.launch.pipeline import run_pipeline_job
from flotilla.launch.supervisor import Supervisor

from ._jobs import processes_mentioning, records, start, stop, training_steps
from ._pipeline_job import FOUR, pipeline_cfg

pytestmark = pytest.mark.timeout(200)
STEPS = 40
STAGE_OPS = ("stage_join", "stage_beat", "stage_weights", "stage_result", "stage_failed")


def _run(tmp_path: Path, strategy: dict, faults: NetFaults) -> tuple[list[dict], dict, str]:
    config = {
        "cluster": {"num_workers": 3, "host": "127.0.0.1"},
        "job": {
            "model": {"name": "tiny_mlp"},
            "dataset": {"name": "synthetic", "num_samples": 2000, "test_fraction": 0.2},
            "optimizer": {"kind": "sgd", "lr": 0.1, "momentum": 0.9},
            "batch_size": 64,
            "steps": STEPS,
            "seed": 0,
            "eval_every_steps": 0,
        },
        "strategy": strategy,
        "report": {"metrics_every_steps": 1, "digest_every_steps": 1, "trackers": []},
    }
    (tmp_path / "job.json").write_text(json.dumps(config))
    args = ["run", str(tmp_path / "job.json"), "--report", str(tmp_path / "report")]
    args += ["--run-dir", str(tmp_path / "run"), "--no-progress"]
    proc = start(args, tmp_path / "launcher.log", env={ENV_VAR: faults.to_json()})
    try:
        assert proc.wait(timeout=180) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    finally:
        stop(proc)
    assert processes_mentioning(str(tmp_path)) == []
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "run").glob("w*.log"))
    return training_steps(records(tmp_path / "report")), summary, logs


def _once_each(steps: list[dict], *, every_step: bool) -> None:
    """Every step committed once per worker, each worker's steps from 0 without a gap; with
    ``every_step``, every worker trained the job's every step (partial reduce: a worker left
    alone at the end is told ``done``, docs/partial_reduce.md, so only the fastest surely does)."""
    committed = Counter((r["worker_id"], r["step"]) for r in steps if r["committed"])
    assert all(n == 1 for n in committed.values()), [k for k, n in committed.items() if n > 1]
    assert {w for w, _ in committed} == {0, 1, 2}
    trained = {w: sorted(s for v, s in committed if v == w) for w in range(3)}
    assert all(t == list(range(len(t))) for t in trained.values()), trained
    assert max(len(t) for t in trained.values()) == STEPS
    if every_step:
        assert all(len(t) == STEPS for t in trained.values())


def test_allreduce_trains_through_collective_resets_with_every_worker(tmp_path: Path) -> None:
    steps, summary, logs = _run(
        tmp_path, {"kind": "allreduce", "step_timeout_s": 10.0}, NetFaults(collective_reset=0.03, seed=2)
    )
    assert summary["completed"] and not summary.get("members_lost")
    resets = logs.count("connection reset by the network")
    assert resets >= 1 and summary["membership_epochs"] > 1
    _once_each(steps, every_step=True)
    digests: dict[int, set[str]] = defaultdict(set)
    for r in steps:
        if r["committed"] and r.get("digest"):
            digests[r["step"]].add(r["digest"])
    assert sorted(digests) == list(range(STEPS)) and all(len(d) == 1 for d in digests.values())
    print(f"\nallreduce: {resets} resets, {summary['membership_epochs']} views, every step atomic")


def test_partial_reduce_trains_through_collective_resets_with_every_worker(tmp_path: Path) -> None:
    steps, summary, _ = _run(
        tmp_path, {"kind": "partial_reduce", "group_size": 2}, NetFaults(collective_reset=0.05, seed=2)
    )
    assert summary["completed"] and not summary.get("members_lost")
    _once_each(steps, every_step=False)
    failed = sum(1 for r in steps if r.get("pr_committed") is False and r.get("pr_group_size", 1) > 1)
    assert failed >= 1  # (groups the network broke: their members trained on, none taken for dead)
    print(f"\npartial reduce: {failed} group reductions broken by the network, every worker to the end")


def _pipeline(tmp_path: Path, *sets: str) -> tuple[dict, bytes, str]:
    cfg = pipeline_cfg(tmp_path, "job.steps=16", "job.eval_every_steps=0", *sets)
    run = tmp_path / "run"
    summary = run_pipeline_job(cfg, tmp_path / "report", run, False, supervisor=Supervisor(run))
    logs = "".join(p.read_text(errors="replace") for p in run.glob("*.log"))
    return summary, (tmp_path / "report" / "model.safetensors").read_bytes(), logs


def test_a_pipeline_re_forms_its_stage_group_and_trains_what_it_trains_without_faults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The network resets the stage group's connections and, on the way to the pipeline's host,
    drops, duplicates, reorders and delays 10 % of the stages' messages each and loses 10 % of the
    replies (joins, beats, weights, results: each sent again until answered, a repeat answered as
    the first): the same weights as without faults."""
    (tmp_path / "clean").mkdir()
    clean, clean_weights, _ = _pipeline(tmp_path / "clean")
    p = 0.1
    lossy = NetFaults(drop=p, duplicate=p, delay=p, reorder=p, lose_reply=p, ops=STAGE_OPS)
    monkeypatch.setenv(ENV_VAR, replace(lossy, collective_reset=0.01, seed=1).to_json())
    (tmp_path / "faulty").mkdir()
    with caplog.at_level(logging.WARNING, logger="flotilla"):
        faulty, weights, logs = _pipeline(tmp_path / "faulty")
    reformed = logs.count("re-formed as pp/0/epoch/")
    assert reformed >= 1 and logs.count("connection reset by the network") >= 1
    assert "rejected message(s) for replay" in caplog.text  # (the duplicates the host refused)
    assert faulty["completed"] and faulty["restarts"] == [] and faulty["steps"] == 16
    assert faulty["membership_epochs"] > 1 and clean["membership_epochs"] == 1
    assert faulty["train_losses"] == clean["train_losses"]  # (bitwise: the same steps, redone)
    assert weights == clean_weights
    again = logs.count("sending it again")
    print(
        f"\npipeline: {reformed} stage re-formings, {again} reports sent again, no restart, the same weights"
    )


def test_two_pipeline_instances_regroup_and_train_what_they_train_without_resets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sets = (FOUR, "strategy.replicas=2", "strategy.num_microbatches=2")
    (tmp_path / "clean").mkdir()
    clean, clean_weights, _ = _pipeline(tmp_path / "clean", *sets)
    # (a re-forming whose instances stand at different steps sends the state: packed in a few
    # buckets it survives 1 % per launch; one broadcast per tensor did not)
    monkeypatch.setenv(ENV_VAR, NetFaults(collective_reset=0.01, seed=1).to_json())
    (tmp_path / "faulty").mkdir()
    faulty, weights, logs = _pipeline(tmp_path / "faulty", *sets)
    assert logs.count("connection reset by the network") >= 1 and faulty["instances_regrouped"]
    assert faulty["completed"] and faulty["restarts"] == [] and faulty["instances_lost"] == []
    assert faulty["steps"] == 16 and faulty["replicas_identical"] is True
    assert faulty["train_losses"] == clean["train_losses"]
    assert weights == clean_weights
    print(f"\ntwo instances: {len(faulty['instances_regrouped'])} regroups, nothing lost, the same weights")
