"""One job across two "hosts" made of network namespaces (``_netns.py``), roles started by hand
as ``docs/multihost.md`` says: the coordinator and w0 on host A, w1 on host B, joined by a veth
pair and nothing else.  Each host's hostname resolves to 127.0.0.1 (as on many Debian hosts): a
plane that advertised it would be unreachable from the other host (issue 22).

Skipped with the reason where namespaces cannot be made (not root, no ``ip``).  The hosts are
deleted in the fixture's teardown, on failure too.  Waits are for events (a log line, a process
exit); the timeouts are safety nets.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from flotilla.comm.auth import generate_secret, write_secret_file
from tests.multiproc._jobs import records, training_steps, wait_for

pytestmark = pytest.mark.timeout(240)

PORT = 5555


def _coordinator(hosts, tmp: Path, *sets: str, extra: list[str] = ()):
    a = hosts[0]
    log = tmp / "coordinator.log"
    args = ["coordinator", "examples/tiny.yaml", "--secret-file", str(tmp / "secret"), "--port", str(PORT)]
    args += ["--report", str(tmp / "report"), "--set", f"cluster.host={a.address}"]
    for s in sets:
        args += ["--set", s]
    proc = hosts.start(a, [*args, *extra], log)
    wait_for(
        lambda: "coordinator listening on" in log.read_text() or proc.poll() is not None, 60, "listening"
    )
    assert proc.poll() is None, log.read_text()[-3000:]
    return proc


def _worker(hosts, tmp: Path, host: int, name: str, env: dict | None = None, *extra: str):
    args = ["worker", "--coordinator", f"{hosts[0].address}:{PORT}", "--secret-file", str(tmp / "secret")]
    return hosts.start(hosts[host], [*args, "--name", name, *extra], tmp / f"{name}.log", env=env)


def _logs(tmp: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("*.log")))


def test_allreduce_trains_on_two_hosts_with_both_workers(hosts, tmp_path):
    t0 = time.monotonic()
    coord = _coordinator(hosts, tmp_path)
    w0 = _worker(hosts, tmp_path, 0, "w0")
    w1 = _worker(hosts, tmp_path, 1, "w1")
    codes = [p.wait(timeout=180) for p in (coord, w0, w1)]
    print(f"\ntwo-host allreduce: {time.monotonic() - t0:.1f} s from the coordinator's start to every exit")
    assert codes == [0, 0, 0], _logs(tmp_path)
    steps = training_steps(records(tmp_path / "report"))
    committed = [r for r in steps if r["committed"]]
    assert {r["step"] for r in committed} == set(range(30))
    assert {r["world_size"] for r in steps} == {2}, "a step ran without both workers"
    assert {r["name"] for r in committed} == {"w0", "w1"}
    for step in range(30):  # both workers committed every step, with one set of parameters
        digests = {r["name"]: r["digest"] for r in committed if r["step"] == step}
        assert set(digests) == {"w0", "w1"} and len(set(digests.values())) == 1, (step, digests)
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["completed"] and summary["members_lost"] == [] and summary["num_workers"] == 2
    assert (tmp_path / "report" / "loss_vs_time.png").is_file()
    for name, h in (("w0", hosts[0]), ("w1", hosts[1])):  # each logged the address it used
        text = (tmp_path / f"{name}.log").read_text()
        assert f"collective plane (gloo): {h.address}" in text, text[-3000:]
        assert f"message plane: {h.address}" in text, text[-3000:]


def test_a_worker_that_cannot_reach_its_peer_fails_its_join_and_the_job_says_a_member_was_lost(
    hosts, tmp_path
):
    """Both workers' gloo on loopback (what a hostname resolving to 127.0.0.1 gave before): the
    one that connects fails its join naming the address; the job ends with one worker, and the
    coordinator's exit status and summary say a member was lost, when and why."""
    coord = _coordinator(hosts, tmp_path, "strategy.step_timeout_s=3", "cluster.heartbeat_timeout_s=2")
    lo = {"GLOO_SOCKET_IFNAME": "lo"}
    workers = {"w0": _worker(hosts, tmp_path, 0, "w0", lo), "w1": _worker(hosts, tmp_path, 1, "w1", lo)}
    codes = {n: p.wait(timeout=180) for n, p in workers.items()}
    coord_code = coord.wait(timeout=60)
    failed = [n for n, c in codes.items() if c != 0]
    assert len(failed) == 1, (codes, _logs(tmp_path))
    errors = [
        ln for ln in (tmp_path / f"{failed[0]}.log").read_text().splitlines() if ln.startswith("error:")
    ]
    assert len(errors) == 1 and "cannot reach peer 127.0.0.1:" in errors[0], _logs(tmp_path)
    assert coord_code == 3, _logs(tmp_path)  # completed, members lost
    coord_log = (tmp_path / "coordinator.log").read_text()
    assert f"member lost: {failed[0]}" in coord_log
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    lost = summary["members_lost"]
    assert [m["name"] for m in lost] == failed and lost[0]["why"] and lost[0]["at_s"] > 0


PS = "strategy={kind: ps, consistency: bsp, num_servers: 2}"


def test_ps_servers_on_another_host_than_their_workers(hosts, tmp_path):
    """Both shards on host B, the coordinator and both workers on host A; each shard binds the
    address of its route to the coordinator (``flotilla server --coordinator … --port …``)."""
    b = hosts[1]
    servers = [f"{b.address}:{PORT + 1 + i}" for i in range(2)]
    coord = _coordinator(hosts, tmp_path, PS, extra=[a for s in servers for a in ("--ps-server", s)])
    for i in range(2):
        args = [
            "server",
            "examples/tiny.yaml",
            "--shard-index",
            str(i),
            "--secret-file",
            str(tmp_path / "secret"),
        ]
        # no --bind: the route to the coordinator (host B's address), this port
        args += ["--coordinator", f"{hosts[0].address}:{PORT}", "--port", str(PORT + 1 + i)]
        hosts.start(b, [*args, "--set", PS], tmp_path / f"server{i}.log")
    workers = [_worker(hosts, tmp_path, 0, name) for name in ("w0", "w1")]
    codes = [p.wait(timeout=180) for p in (*workers, coord)]
    assert codes == [0, 0, 0], _logs(tmp_path)
    steps = training_steps(records(tmp_path / "report"))
    assert {r["name"] for r in steps if r["committed"]} == {"w0", "w1"}
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["completed"] and summary["members_lost"] == [] and summary["strategy"] == "ps"
    for i, address in enumerate(servers):
        assert f"listening on tcp://{address}" in (tmp_path / f"server{i}.log").read_text()


def test_roles_started_as_srun_starts_them_need_no_address(hosts, tmp_path):
    """The coordinator on every interface of host A (``--host 0.0.0.0``, as
    ``examples/cluster/slurm.sbatch``); each worker gets only SLURM's environment: the
    coordinator is the first host of the node list, the name ``w<SLURM_PROCID>``.  The workers
    start first (srun starts every task at once): they wait for the coordinator to answer."""
    a = hosts[0]
    write_secret_file(tmp_path / "secret", generate_secret())
    nodes = f"{a.address},{hosts[1].address}"
    workers = []
    for procid in range(2):
        env = {
            "SLURM_JOB_NODELIST": nodes,
            "SLURM_PROCID": str(procid),
            "FLOTILLA_COORDINATOR_PORT": str(PORT),
        }
        args = ["worker", "--secret-file", str(tmp_path / "secret")]
        workers.append(hosts.start(hosts[procid], args, tmp_path / f"w{procid}.log", env=env))
    w1_log = tmp_path / "w1.log"
    wait_for(
        lambda: "waiting for the coordinator" in w1_log.read_text(), 120, "w1 waiting for the coordinator"
    )
    args = ["coordinator", "examples/tiny.yaml", "--secret-file", str(tmp_path / "secret")]
    args += ["--host", "0.0.0.0", "--port", str(PORT), "--report", str(tmp_path / "report")]
    coord = hosts.start(a, args, tmp_path / "coordinator.log")
    codes = [p.wait(timeout=180) for p in (*workers, coord)]
    assert codes == [0, 0, 0], _logs(tmp_path)
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["completed"] and summary["members_lost"] == []
    assert sorted(w["name"] for w in summary["workers"]) == ["w0", "w1"]
    assert {r["world_size"] for r in training_steps(records(tmp_path / "report"))} == {2}
    w1 = w1_log.read_text()
    assert (
        f"coordinator {a.address}:{PORT} from SLURM_JOB_NODELIST" in w1 and "name w1 from SLURM_PROCID" in w1
    )


def test_one_host_killed_mid_run_the_survivor_finishes_and_the_loss_is_reported(hosts, tmp_path):
    """Host B's processes are killed once w1 has committed steps: w0 (host A) trains on alone
    to the last step, and the coordinator's summary and exit status say w1 was lost."""
    steps = 600
    coord = _coordinator(hosts, tmp_path, f"job.steps={steps}", "job.eval_every_steps=0")
    w0 = _worker(hosts, tmp_path, 0, "w0")
    _worker(hosts, tmp_path, 1, "w1")

    def w1_committed() -> bool:
        return any(
            r["name"] == "w1" and r["committed"] and r["step"] >= 10 for r in records(tmp_path / "report")
        )

    wait_for(w1_committed, 120, "w1's committed steps")
    hosts.kill_host(hosts[1])
    assert w0.wait(timeout=180) == 0, _logs(tmp_path)
    assert coord.wait(timeout=60) == 3, _logs(tmp_path)
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == steps
    (lost,) = summary["members_lost"]
    # (proof of death: the end of a liveness connection to w1, held by its ring neighbour or by
    # the coordinator, whichever read it first)
    gone = ("neighbour watch found it gone", "its liveness connection closed")
    assert lost["name"] == "w1" and any(g in lost["why"] for g in gone), lost
    w0 = sorted(
        (r["step"], r["world_size"])
        for r in training_steps(records(tmp_path / "report"))
        if r["name"] == "w0" and r["committed"]
    )
    sizes = [size for _, size in w0]
    assert sizes == sorted(sizes, reverse=True), "world size 2, then 1 after the kill"
    assert sizes[0] == 2 and sizes[-1] == 1, "the host was not killed mid-run: nothing was tested"
    assert [step for step, _ in w0] == list(range(steps)), "every step committed once on w0"
    assert "member lost: w1 (worker" in (tmp_path / "coordinator.log").read_text()
