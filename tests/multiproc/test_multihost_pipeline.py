"""A two-stage pipeline across two "hosts" made of network namespaces (``_netns.py``), started by
hand as ``docs/multihost.md`` says: ``flotilla coordinator`` and stage 0 on host A, stage 1 on
host B, joined by a veth pair and nothing else (each host's hostname resolves to 127.0.0.1, so a
plane that advertised it would be unreachable from the other host).  It trains to the same losses,
step by step, as the same job run by ``flotilla run`` on one host.

Skipped with the reason where namespaces cannot be made (not root, no ``ip``).  The hosts are
deleted in the fixture's teardown, on failure too.  Waits are for events; timeouts are safety nets.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flotilla.comm.auth import generate_secret, write_secret_file
from flotilla.launch.pipeline import run_pipeline_job
from tests.multiproc._jobs import records, wait_for
from tests.multiproc._pipeline_job import CONFIG, hetpipe_nodes, pipeline_cfg

pytestmark = pytest.mark.timeout(240)

PORT = 5555


def _losses(report: Path) -> dict[int, float]:
    recs = records(report)
    return {r["step"]: r["loss"] for r in recs if r.get("stage_idx") == 1 and r["loss"] is not None}


def _logs(tmp: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("*.log")))


def test_a_pipeline_with_one_stage_per_host_trains_as_on_one_host(hosts, tmp_path):
    a, b = hosts[0], hosts[1]
    (tmp_path / "pipe.yaml").write_text(CONFIG)
    write_secret_file(tmp_path / "secret", generate_secret())
    secret = ["--secret-file", str(tmp_path / "secret")]
    log = tmp_path / "coordinator.log"
    args = ["coordinator", str(tmp_path / "pipe.yaml"), *secret, "--port", str(PORT)]
    coord = hosts.start(a, [*args, "--report", str(tmp_path / "report"), "--host", a.address], log)
    wait_for(lambda: "listening on" in log.read_text() or coord.poll() is not None, 120, "listening")
    assert coord.poll() is None, log.read_text()[-3000:]
    join = ["worker", "--coordinator", f"{a.address}:{PORT}", *secret]
    fast = hosts.start(a, [*join, "--name", "fast"], tmp_path / "fast.log")
    slow = hosts.start(b, [*join, "--stage", "1"], tmp_path / "slow.log")
    codes = [p.wait(timeout=200) for p in (coord, fast, slow)]
    assert codes == [0, 0, 0], _logs(tmp_path)
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 8
    # stage 1 reached the store and stage 0 across the veth: on host B's address, not loopback
    assert f"collective plane (gloo): {b.address}" in (tmp_path / "slow.log").read_text()
    assert f"collective plane (gloo): {a.address}" in (tmp_path / "fast.log").read_text()

    ref = tmp_path / "ref"
    ref.mkdir()
    reference = run_pipeline_job(pipeline_cfg(ref), ref / "report", ref / "run", progress=False)
    got, want = _losses(tmp_path / "report"), _losses(ref / "report")
    assert sorted(got) == list(range(1, 9)) and got == pytest.approx(want, abs=1e-6), (got, want)
    assert summary["evals"][-1]["test_loss"] == pytest.approx(reference["evals"][-1]["test_loss"], abs=1e-6)


def test_hetpipe_virtual_workers_on_two_hosts_reach_the_shards_across_the_link(hosts, tmp_path):
    """VW 0 (a0) on host A beside the coordinator, VW 1 (b0, b1) on host B; the coordinator binds
    every interface, so host B reaches its parameter-server shards only at the address it dialled
    (0.0.0.0 there is host B's own loopback)."""
    a, b = hosts[0], hosts[1]
    (tmp_path / "hp.yaml").write_text(hetpipe_nodes(20))
    write_secret_file(tmp_path / "secret", generate_secret())
    secret = ["--secret-file", str(tmp_path / "secret")]
    log = tmp_path / "coordinator.log"
    args = ["coordinator", str(tmp_path / "hp.yaml"), *secret, "--port", str(PORT), "--host", "0.0.0.0"]
    coord = hosts.start(a, [*args, "--report", str(tmp_path / "report")], log)
    wait_for(lambda: "listening on" in log.read_text() or coord.poll() is not None, 120, "listening")
    assert coord.poll() is None, log.read_text()[-3000:]
    join = ["worker", "--coordinator", f"{a.address}:{PORT}", *secret]
    procs = [
        hosts.start(h, [*join, "--name", n], tmp_path / f"{n}.log")
        for h, n in ((a, "a0"), (b, "b0"), (b, "b1"))
    ]
    codes = [p.wait(timeout=200) for p in (coord, *procs)]
    assert codes == [0, 0, 0, 0], _logs(tmp_path)
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 20
    assert [v["devices"] for v in summary["placement"]["vws"]] == [["a0"], ["b0", "b1"]]
    assert summary["hetpipe"]["minibatches_checked"] == 3 * 20
    assert f"parameter servers at tcp://{a.address}:" in (tmp_path / "b1.log").read_text()
