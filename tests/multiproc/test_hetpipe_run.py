"""``flotilla run`` with ``strategy: {kind: hetpipe}``: two virtual workers (VWs) of two stage
processes each on 127.0.0.1, syncing through the parameter-server shards the launcher hosts
under WSP (``sync/hetpipe.py``).  The job trains (the loss falls; the exported model is the
servers' final state), every stage checked SPEC §2's bound on every one of its forwards and the
summary reports the largest staleness seen beside s_global; a stage SIGKILLed mid-run (at a
step the test picks) loses its VW only: the VW is evicted from the servers and the other trains
to the end without a restart."""

from __future__ import annotations

import math
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flotilla.launch.pipeline import run_pipeline_job
from flotilla.launch.supervisor import Supervisor

from ._hetpipe_account import check_account
from ._pipeline_job import FOUR, pipeline_cfg, run_killing

HETPIPE = (
    "strategy={kind: hetpipe, placement: given, num_stages: 2, replicas: 2, s_local: 1, clock_distance: 0, "
    "step_timeout_s: 20}"
)


def _kill_b1(
    tmp_path: Path, *, steps: int, returns: int, stages: tuple[str, ...] = ("b1",)
) -> tuple[dict, dict]:
    """The two VWs at speeds 1.0 / 0.25 (slower steps: the kill lands mid-run) for ``steps``
    steps, b1 (VW 1's second stage; or ``stages``, at once) SIGKILLed at step 10; ``returns``:
    job.max_restarts."""
    slow = FOUR.replace("speed: 0.5", "speed: 0.25")
    overrides = (f"job.steps={steps}", "job.eval_every_steps=0", f"job.max_restarts={returns}")
    return run_killing(pipeline_cfg(tmp_path, slow, HETPIPE, *overrides), tmp_path, stages, 10)


@pytest.mark.timeout(180)
def test_virtual_workers_train_and_every_forward_keeps_the_staleness_bound(tmp_path: Path) -> None:
    cfg = pipeline_cfg(tmp_path, FOUR, HETPIPE, "job.steps=40", "job.eval_every_steps=0")
    sup = Supervisor(tmp_path / "run")
    summary = run_pipeline_job(cfg, tmp_path / "report", tmp_path / "run", False, supervisor=sup)
    assert all(c.proc.returncode == 0 for c in sup.children) and len(sup.children) == 4
    assert summary["completed"] and summary["strategy"] == "hetpipe" and summary["steps"] == 40
    hp = summary["hetpipe"]
    assert hp["s_global"] == 2 and hp["minibatches_checked"] == 4 * 40  # every forward of every stage
    assert 0 < hp["max_staleness"] <= hp["s_global"]
    assert [v["vw"] for v in hp["virtual_workers"]] == [0, 1] and hp["evicted"] == []
    assert check_account(summary, tmp_path / "report", steps=40, batch=16, wave=2)["dropped"] == 0
    losses = summary["train_losses"]
    assert sum(losses[-8:]) / 8 < 0.9 * sum(losses[:8]) / 8
    # the exported model is the servers' final state (both VWs' last waves), not the lead VW's own
    # weights (which lack the other VW's last wave)
    exported = load_file(summary["model_file"])
    run = tmp_path / "run"
    stage0 = load_file(str(run / "stage0.safetensors"))  # (the first layers: the same names)
    shared = [k for k in stage0 if k in exported]
    assert shared and any(not torch.equal(exported[k], stage0[k]) for k in shared)
    assert math.isfinite(summary["test_loss"])  # (evaluated on the exported model)


@pytest.mark.timeout(240)
def test_a_killed_stage_loses_its_virtual_worker_and_the_other_trains_to_the_end(tmp_path: Path) -> None:
    summary, killed = _kill_b1(tmp_path, steps=120, returns=0)
    assert summary["completed"] and summary["restarts"] == []
    lost = summary["instances_lost"]
    assert [(e["instance"], e["stage"], e["exit_code"]) for e in lost] == [(1, "b1", -signal.SIGKILL)]
    assert summary["hetpipe"]["evicted"] == [1]
    assert [s["replica"] for s in summary["stages"]] == [0, 0]  # (the survivors' stages)
    assert summary["hetpipe"]["minibatches_checked"] == 2 * 120  # the survivor ran every minibatch
    assert summary["hetpipe"]["max_staleness"] <= summary["hetpipe"]["s_global"]
    # the survivor took over VW 1's share from the view without it; what VW 1 left in between is
    # listed as dropped: every sample of every step trained once or dropped
    account = check_account(summary, tmp_path / "report", steps=120, batch=16, wave=2)
    views = summary["data_views"]["views"]
    assert views[0][1] == [0, 1] and views[-1][1] == [0], views
    assert [d[0] for d in summary["data_views"]["dropped"]] in ([], [1])
    print(
        f"\nkilled b1 at step {killed['step']}: VW 1 evicted, VW 0 trained all 120 steps, from wave "
        f"{views[-1][0]} on the whole batch; samples trained {account['trained']}, "
        f"dropped {account['dropped']}"
    )


@pytest.mark.timeout(300)
def test_a_lost_virtual_worker_comes_back_as_a_new_worker_and_the_account_stays_exact(tmp_path: Path) -> None:
    summary, killed = _kill_b1(tmp_path, steps=160, returns=1)
    assert summary["completed"] and summary["restarts"] == []
    assert [(e["instance"], e["stage"]) for e in summary["instances_lost"]] == [(1, "b1")]
    assert [e["instance"] for e in summary["instances_back"]] == [1]
    hp = summary["hetpipe"]
    assert hp["evicted"] == [1] and [v["vw"] for v in hp["virtual_workers"]] == [0, 1]
    assert hp["max_staleness"] <= hp["s_global"]
    views = summary["data_views"]["views"]
    back = views[-1][1]  # (VW 1 under its new worker id: 1 + 2 * its arrival)
    assert views[0][1] == [0, 1] and len(back) == 2 and back[0] == 0 and back[1] % 2 == 1 and back[1] > 1
    first_wave = views[-1][0]
    # the new VW 1 ran every minibatch from its first wave (its records: every forward of both stages)
    assert hp["minibatches_checked"] == 2 * 160 + 2 * (160 - 2 * first_wave)
    assert sorted(s["replica"] for s in summary["stages"]) == [0, 0, 1, 1]
    account = check_account(summary, tmp_path / "report", steps=160, batch=16, wave=2)
    losses = summary["train_losses"]  # (the lead: VW 0, which trained from the start)
    assert len(losses) == 160 and sum(losses[-16:]) < sum(losses[:16])
    back_s = summary["instances_back"][0]["at"] - summary["instances_lost"][0]["at"]
    waited = hp["virtual_workers"][0]["gate_wait_s"]
    print(
        f"\nkilled b1 at step {killed['step']}: VW 1 evicted, back as worker {back[1]} from wave "
        f"{first_wave} {back_s:.2f} s after its loss; VW 0 waited {waited:.2f} s "
        f"at the gate in all; samples trained {account['trained']}, dropped {account['dropped']}"
    )


@pytest.mark.timeout(300)
def test_every_virtual_worker_lost_at_once_comes_back_from_the_servers_and_the_account_stays_exact(
    tmp_path: Path,
) -> None:
    """Every stage process SIGKILLed together (the launcher finds them all gone at once): no VW
    trains, but the servers hold the state, so the job waits -- each VW comes back, one after the
    other, as a new worker from the servers' global clock -- and ends with every step trained or
    listed as dropped."""
    summary, killed = _kill_b1(tmp_path, steps=120, returns=2, stages=("a0", "a1", "b0", "b1"))
    assert summary["completed"] and summary["restarts"] == [], summary.get("degraded")
    assert sorted(e["instance"] for e in summary["instances_lost"]) == [0, 1]
    assert summary["instances_lost"][-1]["survivors"] == []  # (none trained until a return)
    assert sorted(e["instance"] for e in summary["instances_back"]) == [0, 1]
    hp = summary["hetpipe"]
    assert sorted(hp["evicted"]) == [0, 1] and hp["max_staleness"] <= hp["s_global"]
    account = check_account(summary, tmp_path / "report", steps=120, batch=16, wave=2)
    gap = summary["instances_back"][0]["at"] - summary["instances_lost"][-1]["at"]
    print(
        f"\nkilled every stage at step {killed['step']}: no VW for {gap:.2f} s, both back as new workers; "
        f"samples trained {account['trained']}, dropped {account['dropped']}"
    )
