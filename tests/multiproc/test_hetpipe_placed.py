"""``flotilla run`` with ``strategy: {kind: hetpipe, placement: np}``: the launcher forms the
virtual workers (VWs) from the devices' nodes and cuts each over its own devices
(``sync/hetpipe_place.py``), so VWs of different stage counts train side by side.  Node ``n0`` is
one device that holds the model alone (a VW of one stage); node ``n1`` is two devices of 5 MiB
each, too little for the model alone (a VW of two stages, its own cut).  The job trains, every
forward of every stage keeps SPEC §2's bound, and a SIGKILLed stage of the two-stage VW loses
that VW only: the one-stage VW trains to the end (with the workers declared out of the stage
processes' order, and the lost VW the lead one)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from flotilla.launch.pipeline import run_pipeline_job
from flotilla.launch.supervisor import Supervisor

from ._hetpipe_account import check_account
from ._pipeline_job import pipeline_cfg, run_killing

NODES = (
    "cluster.workers=[{name: a0, node: n0, speed: 1.0, memory_bytes: 64MiB}, "
    "{name: b0, node: n1, speed: 1.0, memory_bytes: 5MiB}, "
    "{name: b1, node: n1, speed: 1.0, memory_bytes: 5MiB}]"
)
HETPIPE = "strategy={kind: hetpipe, placement: np, s_local: 1, clock_distance: 0, step_timeout_s: 20}"


def _check_placement(summary: dict) -> None:
    placement = summary["placement"]
    assert placement["configured"] == placement["policy"] == "np" and placement["unused"] == []
    vws = placement["vws"]
    assert [v["devices"] for v in vws] == [["a0"], ["b0", "b1"]]
    assert vws[0]["layer_ends"] == [6] and len(vws[1]["layer_ends"]) == 2 and vws[1]["layer_ends"][-1] == 6


@pytest.mark.timeout(180)
def test_virtual_workers_of_different_cuts_train_side_by_side(tmp_path: Path) -> None:
    cfg = pipeline_cfg(tmp_path, NODES, HETPIPE, "job.steps=30", "job.eval_every_steps=0")
    sup = Supervisor(tmp_path / "run")
    summary = run_pipeline_job(cfg, tmp_path / "report", tmp_path / "run", False, supervisor=sup)
    assert all(c.proc.returncode == 0 for c in sup.children)
    assert sorted(c.name for c in sup.children) == ["a0", "b0", "b1"]
    assert summary["completed"] and summary["steps"] == 30 and summary["replicas"] == 2
    _check_placement(summary)
    assert [(s["name"], s["replica"]) for s in summary["stages"]] == [("a0", 0), ("b0", 1), ("b1", 1)]
    assert summary["replicas_identical"] is None  # (cut differently: nothing to compare)
    charts = summary["gantt_instances"]  # (each VW at its own pace: one measured timeline each)
    assert sorted(charts) == ["0", "1"] and all(Path(p).stat().st_size > 0 for p in charts.values())
    hp = summary["hetpipe"]
    assert hp["minibatches_checked"] == 3 * 30 and hp["max_staleness"] <= hp["s_global"] == 2
    losses = summary["train_losses"]
    assert sum(losses[-6:]) / 6 < 0.9 * sum(losses[:6]) / 6
    assert check_account(summary, tmp_path / "report", steps=30, batch=16, wave=2)["dropped"] == 0


# the same devices declared b0, a0, b1: np's VWs follow the nodes' order (n1 first), so VW 0 is
# b0, b1 and the stage processes (b0, b1, a0) are not in the workers' order
MIXED_ORDER = (
    "cluster.workers=[{name: b0, node: n1, speed: 1.0, memory_bytes: 5MiB}, "
    "{name: a0, node: n0, speed: 1.0, memory_bytes: 64MiB}, "
    "{name: b1, node: n1, speed: 1.0, memory_bytes: 5MiB}]"
)


@pytest.mark.timeout(240)
def test_a_killed_stage_of_the_two_stage_vw_leaves_the_one_stage_vw_training(tmp_path: Path) -> None:
    cfg = pipeline_cfg(
        tmp_path, MIXED_ORDER, HETPIPE, "job.steps=120", "job.eval_every_steps=0", "job.max_restarts=0"
    )
    summary, killed = run_killing(cfg, tmp_path, "b1", 10)
    assert summary["completed"] and summary["restarts"] == []
    vws = summary["placement"]["vws"]
    assert [v["devices"] for v in vws] == [["b0", "b1"], ["a0"]]
    lost = summary["instances_lost"]
    assert [(e["instance"], e["stage"], e["exit_code"]) for e in lost] == [(0, "b1", -signal.SIGKILL)]
    assert summary["hetpipe"]["evicted"] == [0]  # (the lead VW lost: VW 1 leads from then on)
    assert [(s["name"], s["replica"]) for s in summary["stages"]] == [("a0", 1)]
    assert summary["hetpipe"]["minibatches_checked"] == 120  # the survivor ran every minibatch
    account = check_account(summary, tmp_path / "report", steps=120, batch=16, wave=2)
    assert account["trained"] > 120 * 8  # (the survivor trained the whole batch once VW 0 was out)
