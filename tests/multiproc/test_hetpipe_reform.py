"""HetPipe with ``reform: true`` (``flotilla run``): a virtual worker (VW) lost because one of its
stages died is formed again **without that device** -- from its surviving devices and the devices
no VW uses (``launch/pipeline_reform.py`` over ``pipeline/vw_reform.reform``) -- on new stage
processes that join the servers as a new worker.

The cluster: ``a0`` holds the model alone (node n0); ``b0``, ``b1`` (node n1) and ``c0`` (node n2)
have 5 MiB each, too little alone.  ``placement: hd`` forms VW 0 = a0 and VW 1 = b0, b1 and leaves
c0 unused.  SIGKILLing b1 loses VW 1; it is formed again on b0 and c0 (b1 is never started again,
though ``job.max_restarts`` would allow it), trains to the end, and every sample of every step is
trained by exactly one VW or listed as dropped.  Without a free device (no c0) VW 1 cannot be
formed again (b0 alone is short of memory): it waits, VW 0 trains to the end, and the summary
says why -- until a revocation schedule adds a device (``cluster.revocations``: ``kill`` revokes
the device of a stage, ``add`` makes one free).  ``flotilla coordinator`` cannot start stage
processes on other devices and refuses ``reform: true`` in one line before it listens."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import pytest

from flotilla.core.errors import FlotillaError
from flotilla.launch.pipeline import run_pipeline_job
from flotilla.launch.supervisor import Supervisor

from ._hetpipe_account import check_account
from ._pipeline_job import HETPIPE_NODES, kill_stage_at, pipeline_cfg

WORKERS = (
    "{name: a0, node: n0, speed: 1.0, memory_bytes: 64MiB}",
    "{name: b0, node: n1, speed: 1.0, memory_bytes: 5MiB}",
    "{name: b1, node: n1, speed: 1.0, memory_bytes: 5MiB}",
)
SPARE = "{name: c0, node: n2, speed: 1.0, memory_bytes: 5MiB}"
HETPIPE = (
    "strategy={kind: hetpipe, placement: hd, s_local: 1, clock_distance: 0, step_timeout_s: 20, reform: true}"
)


def _run(tmp_path: Path, workers: tuple[str, ...], steps: int) -> tuple[dict, dict, Supervisor]:
    cfg = pipeline_cfg(
        tmp_path,
        f"cluster.workers=[{', '.join(workers)}]",
        HETPIPE,
        f"job.steps={steps}",
        "job.eval_every_steps=0",
        "job.max_restarts=2",
    )
    sup, killed = Supervisor(tmp_path / "run"), {}
    # (stage1.status.json -- b0's, VW 1's first stage -- says how far the job got)
    killer = threading.Thread(
        target=kill_stage_at, args=(sup, tmp_path / "run", "b1", 10, killed), daemon=True
    )
    killer.start()
    try:
        summary = run_pipeline_job(cfg, tmp_path / "report", tmp_path / "run", False, supervisor=sup)
    finally:
        sup.close()  # (its zygote too: not left until the object is collected)
    killer.join()
    assert killed, "b1 was never killed"
    return summary, killed, sup


@pytest.mark.timeout(300)
def test_a_vw_that_lost_a_device_is_formed_again_on_its_survivor_and_a_free_device(tmp_path: Path) -> None:
    summary, killed, sup = _run(tmp_path, (*WORKERS, SPARE), steps=160)
    assert summary["completed"] and summary["restarts"] == []
    assert summary["placement"]["vws"][1]["devices"] == ["b0", "b1"] and summary["placement"]["unused"] == [
        "c0"
    ]
    assert [(e["instance"], e["stage"], e["exit_code"]) for e in summary["instances_lost"]] == [
        (1, "b1", -signal.SIGKILL)
    ]
    formed = summary["instances_reformed"]
    assert [(f["instance"], f["gone"], f["devices"], f["processes"]) for f in formed] == [
        (1, "b1", ["b0", "c0"], [3, 4])
    ]
    assert formed[0]["layer_ends"][-1] == 6 and summary["instances_not_reformed"] == []
    assert [e["instance"] for e in summary["instances_back"]] == [1]
    # b1 ran once (never started again); the new VW 1 runs on b0 and c0 as new processes
    assert sorted(c.name for c in sup.children) == ["a0", "b0", "b0~3", "b1", "c0~4"]
    assert [(s["name"], s["replica"]) for s in summary["stages"]] == [("a0", 0), ("b0~3", 1), ("c0~4", 1)]
    hp = summary["hetpipe"]
    assert hp["evicted"] == [1] and hp["max_staleness"] <= hp["s_global"]
    views = summary["data_views"]["views"]
    assert views[0][1] == [0, 1] and views[-1][1] == [0, 3]  # (VW 1 as worker 1 + 2 x its arrival)
    first_wave = views[-1][0]
    assert hp["minibatches_checked"] == 160 + 2 * (160 - 2 * first_wave)  # (VW 0's one stage, VW 1's two)
    account = check_account(summary, tmp_path / "report", steps=160, batch=16, wave=2)
    back_s = summary["instances_back"][0]["at"] - summary["instances_lost"][0]["at"]
    print(
        f"\nkilled b1 at step {killed['step']}: VW 1 formed again on b0, c0, training from wave "
        f"{first_wave}, {back_s:.2f} s after its loss; samples trained {account['trained']}, "
        f"dropped {account['dropped']}"
    )


@pytest.mark.timeout(300)
def test_a_vw_that_no_devices_left_can_hold_waits_and_the_summary_says_why(tmp_path: Path) -> None:
    summary, _killed, sup = _run(tmp_path, WORKERS, steps=80)
    assert summary["completed"] and summary["restarts"] == []
    assert [(e["instance"], e["stage"]) for e in summary["instances_lost"]] == [(1, "b1")]
    assert summary["instances_reformed"] == [] and summary["instances_back"] == []
    (waiting,) = summary["instances_not_reformed"]
    assert waiting["instance"] == 1 and "b0" in waiting["why"] and "short by" in waiting["why"], waiting
    assert sorted(c.name for c in sup.children) == ["a0", "b0", "b1"]  # (b1's device gone: not restarted)
    assert [(s["name"], s["replica"]) for s in summary["stages"]] == [("a0", 0)]
    check_account(summary, tmp_path / "report", steps=80, batch=16, wave=2)


REVOCATIONS = (
    "cluster.revocations={events: [{at_step: 10, action: kill, worker: b1}, "
    "{at_step: 40, action: add, worker: c9}]}"
)


@pytest.mark.timeout(300)
def test_a_revoked_device_s_vw_waits_for_an_added_device_and_is_formed_again_with_it(tmp_path: Path) -> None:
    cfg = pipeline_cfg(
        tmp_path,
        f"cluster.workers=[{', '.join(WORKERS)}]",
        "cluster.defaults={node: n9, speed: 1.0, memory_bytes: 5MiB}",  # (c9, added: the defaults)
        REVOCATIONS,
        HETPIPE,
        "job.steps=160",
        "job.eval_every_steps=0",
        "job.max_restarts=2",
    )
    sup = Supervisor(tmp_path / "run")
    summary = run_pipeline_job(cfg, tmp_path / "report", tmp_path / "run", False, supervisor=sup)
    assert summary["completed"] and summary["restarts"] == []
    done = [json.loads(line) for line in (tmp_path / "report" / "revocations.jsonl").read_text().splitlines()]
    assert [(e["action"], e["worker"]) for e in done] == [("kill", "b1"), ("add", "c9")]
    assert summary["revocations"] == {"kill": 1, "stop": 0, "add": 1}
    on_disk = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert on_disk["revocations"] == summary["revocations"]  # (not the coordinator runs' view figures)
    assert [(e["instance"], e["stage"]) for e in summary["instances_lost"]] == [(1, "b1")]
    formed = summary["instances_reformed"]
    assert [(f["instance"], f["gone"], f["devices"]) for f in formed] == [(1, "b1", ["b0", "c9"])]
    # (b0 alone cannot hold the model: VW 1 waited for c9, added at step 40)
    assert summary["instances_back"][0]["reached_step"] >= done[1]["step"] >= 40
    assert sorted(c.name for c in sup.children) == ["a0", "b0", "b0~3", "b1", "c9~4"]
    hp = summary["hetpipe"]
    assert hp["evicted"] == [1] and hp["max_staleness"] <= hp["s_global"]
    assert summary["data_views"]["views"][-1][1] == [0, 3]
    check_account(summary, tmp_path / "report", steps=160, batch=16, wave=2)


@pytest.mark.timeout(300)
def test_every_vw_lost_with_no_device_left_to_come_ends_the_job_in_one_line(tmp_path: Path) -> None:
    cfg = pipeline_cfg(
        tmp_path,
        f"cluster.workers=[{', '.join(WORKERS)}]",
        "cluster.revocations={events: [{at_step: 10, action: kill, worker: b1}, "
        "{at_step: 20, action: kill, worker: a0}]}",
        HETPIPE,
        "job.steps=400",
        "job.eval_every_steps=0",
        "job.max_restarts=2",
    )
    with pytest.raises(FlotillaError) as err:
        run_pipeline_job(
            cfg, tmp_path / "report", tmp_path / "run", False, supervisor=Supervisor(tmp_path / "run")
        )
    line = str(err.value)
    assert line.startswith("every pipeline instance is lost and none can come back"), line
    assert "instance 0:" in line and "instance 1:" in line and "short by" in line, line
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["completed"] is False and summary["error"] == line


def test_the_coordinator_refuses_reform_in_one_line_before_it_listens(tmp_path: Path) -> None:
    from tests.multiproc._jobs import start

    config = HETPIPE_NODES.replace("HOST", "127.0.0.1").replace("STEPS", "20")
    config = config.replace("clock_distance: 0,", "clock_distance: 0, reform: true,")
    assert "reform: true" in config
    (tmp_path / "hetpipe.yaml").write_text(config)
    args = ["coordinator", str(tmp_path / "hetpipe.yaml"), "--secret-file", str(tmp_path / "secret")]
    proc = start([*args, "--report", str(tmp_path / "r")], tmp_path / "log")
    assert proc.wait(timeout=120) == 2
    out = (tmp_path / "log").read_text()
    assert (
        "strategy.reform: `flotilla coordinator` cannot start stage processes" in out
        and "listening" not in out
    )
