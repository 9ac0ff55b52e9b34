"""HetPipe's virtual workers with their stages started by hand: ``flotilla coordinator`` places the
VWs (``placement: np``), hosts the parameter-server shards beside the stages' rendezvous, and each
stage is a ``flotilla worker --name`` (the path stages on other hosts take).  The job trains to
the end with every forward's staleness checked, the coordinator bound on every interface (the
stages reach its shards where they dialled it); a stage SIGKILLed mid-run loses its VW only, and
the VW comes back when its stages are started again (``-m slow``)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.multiproc._jobs import records, wait_for
from tests.multiproc._pipeline_job import hetpipe_nodes
from tests.multiproc.test_pipeline_hosted import Hosted

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def hosted(tmp_path):
    made: list[Hosted] = []
    yield lambda steps: made.append(Hosted(tmp_path, config=hetpipe_nodes(steps, "0.0.0.0"))) or made[-1]
    for h in made:
        h.close()


def _summary(tmp: Path) -> dict:
    return json.loads((tmp / "report" / "summary.json").read_text())


def _start_and_kill_b1(h: Hosted, tmp_path: Path) -> dict:
    """Start the three stages by hand; SIGKILL b1 (VW 1's second stage) once it trained 5 steps."""
    procs = {name: h.worker(name, "--name", name) for name in ("a0", "b0", "b1")}
    report = tmp_path / "report"
    trained = lambda: sum(r.get("name") == "b1" and r.get("loss") is not None for r in records(report)) >= 5
    wait_for(lambda: trained() or procs["b1"].poll() is not None, 120, "b1 trains")
    assert procs["b1"].poll() is None, h.logs()
    os.kill(procs["b1"].pid, signal.SIGKILL)
    return procs


def test_hand_started_stages_train_the_placed_virtual_workers(hosted, tmp_path: Path) -> None:
    h = hosted(30)
    h.address = "127.0.0.1:" + h.address.rsplit(":", 1)[1]  # (bound on every interface: dial one)
    stages = [h.worker(name, "--name", name) for name in ("b1", "a0", "b0")]  # (any order)
    assert h.coordinator.wait(timeout=200) == 0, h.logs()
    assert all(p.wait(timeout=30) == 0 for p in stages), h.logs()
    s = _summary(tmp_path)
    assert s["completed"] and s["steps"] == 30 and s["strategy"] == "hetpipe"
    assert [v["devices"] for v in s["placement"]["vws"]] == [["a0"], ["b0", "b1"]]
    hp = s["hetpipe"]
    assert hp["minibatches_checked"] == 3 * 30 and hp["max_staleness"] <= hp["s_global"] == 2
    assert s["data_views"]["views"][0][1] == [0, 1] and s["data_views"]["dropped"] == []
    # the shards bound on every interface: each stage reached them where it dialled the coordinator
    port = lambda line: line.rsplit(":", 1)[1]
    for name in ("a0", "b0", "b1"):
        line = next(x for x in h.log(name).splitlines() if "parameter servers at" in x)
        assert "parameter servers at tcp://127.0.0.1:" in line and port(line).isdigit(), line


def test_a_killed_stage_loses_its_virtual_worker_and_the_other_trains_on(hosted, tmp_path: Path) -> None:
    h = hosted(150)
    procs = _start_and_kill_b1(h, tmp_path)
    assert h.coordinator.wait(timeout=200) == 0, h.logs()
    s = _summary(tmp_path)
    assert s["completed"] and s["steps"] == 150
    assert [e["instance"] for e in s["instances_lost"]] == [1] and s["hetpipe"]["evicted"] == [1]
    assert s["hetpipe"]["minibatches_checked"] == 150  # (VW 0: one stage, every minibatch)
    assert s["data_views"]["views"][-1][1] == [0]  # (VW 0 trains the whole batch from then on)
    assert procs["a0"].wait(timeout=30) == 0, h.logs()


@pytest.mark.slow  # (~40 s; the same return under `flotilla run` is in the default suite)
def test_a_lost_virtual_worker_comes_back_when_its_stages_are_started_again(hosted, tmp_path: Path) -> None:
    h = hosted(300)
    procs = _start_and_kill_b1(h, tmp_path)
    assert procs["b0"].wait(timeout=60) != 0, h.logs()  # (told its VW was lost)
    again = [h.worker(f"{name}-again", "--name", name) for name in ("b0", "b1")]  # (by hand, as a user would)
    assert h.coordinator.wait(timeout=200) == 0, h.logs()
    assert all(p.wait(timeout=30) == 0 for p in [procs["a0"], *again]), h.logs()
    s = _summary(tmp_path)
    assert s["completed"] and s["steps"] == 300
    assert [e["instance"] for e in s["instances_lost"]] == [1] and s["hetpipe"]["evicted"] == [1]
    assert [e["instance"] for e in s["instances_back"]] == [1]
    views = s["data_views"]["views"]
    assert views[0][1] == [0, 1] and views[-1][1][0] == 0 and views[-1][1][1] % 2 == 1 < views[-1][1][1]
    hp = s["hetpipe"]
    first_wave = views[-1][0]
    assert hp["minibatches_checked"] == 300 + 2 * (300 - 2 * first_wave)
    assert hp["max_staleness"] <= hp["s_global"]


@pytest.mark.slow  # (~50 s; every VW lost at once under `flotilla run` is in the default suite)
def test_every_virtual_worker_lost_waits_for_its_stages_to_be_started_again(hosted, tmp_path: Path) -> None:
    """a0 (VW 0) and b1 (VW 1) SIGKILLed together: no VW left, but the servers hold the state, so
    the coordinator waits with none training until the stages are started again by hand."""
    h = hosted(200)
    procs = _start_and_kill_b1(h, tmp_path)
    os.kill(procs["a0"].pid, signal.SIGKILL)
    assert procs["b0"].wait(timeout=60) != 0, h.logs()  # (told its VW was lost)
    assert h.coordinator.poll() is None, h.logs()  # (no VW: the job waits)
    again = [h.worker(f"{name}-again", "--name", name) for name in ("a0", "b0", "b1")]
    assert h.coordinator.wait(timeout=200) == 0, h.logs()
    assert all(p.wait(timeout=30) == 0 for p in again), h.logs()
    s = _summary(tmp_path)
    assert s["completed"] and s["steps"] == 200
    assert sorted(e["instance"] for e in s["instances_lost"]) == [0, 1]
    assert s["instances_lost"][-1]["survivors"] == []
    assert sorted(e["instance"] for e in s["instances_back"]) == [0, 1]
    assert sorted(s["hetpipe"]["evicted"]) == [0, 1]


def _train(h: Hosted) -> None:
    stages = [h.worker(name, "--name", name) for name in ("a0", "b0", "b1")]
    try:
        assert h.coordinator.wait(timeout=200) == 0, h.logs()
        assert all(p.wait(timeout=30) == 0 for p in stages), h.logs()
    finally:
        h.close()


def test_a_hosted_job_goes_on_from_its_servers_snapshots_with_resume_auto(tmp_path: Path) -> None:
    _train(Hosted(tmp_path, "checkpoint.every_steps=10", config=hetpipe_nodes(40)))
    first = _summary(tmp_path)
    assert first["completed"] and (tmp_path / "report" / "ps-snapshots" / "ps-shard-0-of-1.snap").is_file()
    again = Hosted(
        tmp_path, "checkpoint.every_steps=10", config=hetpipe_nodes(80), extra=("--resume", "auto")
    )
    assert "resuming from the snapshots in" in again.log()
    _train(again)
    s = _summary(tmp_path)
    assert s["completed"] and s["steps"] == 80
    assert s["resumed"]["clock"] == 20 and s["resumed"]["step"] == 40  # (a wave: 2 steps, s_local 1)
    assert len(s["train_losses"]) == 40  # (steps 41..80 only)
    # from the trained weights: its first losses are those of the first job's end, not a fresh start's
    fresh, before, after = first["train_losses"][:4], first["train_losses"][-4:], s["train_losses"][:4]
    assert abs(sum(after) - sum(before)) < abs(sum(after) - sum(fresh))


def test_resume_on_the_coordinator_is_refused_in_one_line_where_it_cannot_work(tmp_path: Path) -> None:
    from tests.multiproc._jobs import start
    from tests.multiproc.test_pipeline_hosted import CONFIG

    (tmp_path / "pipe.yaml").write_text(CONFIG)  # (kind: pipeline: its checkpoints are the stages')
    (tmp_path / "hetpipe.yaml").write_text(hetpipe_nodes(40))
    base = ["coordinator", "--secret-file", str(tmp_path / "secret"), "--report", str(tmp_path / "r")]
    cases = {
        "pipe.yaml": "strategy pipeline keeps no checkpoints on the coordinator's host",
        "hetpipe.yaml": "no parameter-server snapshot",  # (auto: nothing under --report)
    }
    for name, why in cases.items():
        proc = start([base[0], str(tmp_path / name), *base[1:], "--resume", "auto"], tmp_path / f"{name}.log")
        assert proc.wait(timeout=120) == 2
        out = (tmp_path / f"{name}.log").read_text()
        assert why in out and "listening" not in out, out
