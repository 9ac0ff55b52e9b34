"""Network partitions between two "hosts" made of network namespaces (``_netns.py``; issue 37
item 2): the veth joining them is taken down mid-run and brought up again.

- **A worker cut off** (the coordinator, w0 and w1 on host A; w2 on host B): the coordinator
  declares w2 dead once it is silent for ``cluster.heartbeat_timeout_s``; the majority side
  commits steps during the cut; after the heal w2 learns it was left behind and rejoins as a
  newcomer, committing again within 10 s.
- **The coordinator cut off** (the coordinator alone on host A; every worker on host B): nobody
  can be declared dead by a coordinator that hears nobody (its silence check blames its own
  stall, ``cluster/failure.py``), and the workers need it only for membership changes: they
  commit during the cut (their records wait in their links) and report after the heal.

- **The coordinator cut off with a minority** (the coordinator and w0 on host A; w1 and w2 on
  host B): the lease rule (``cluster/lease.py``).  The coordinator's lease lapses (only one of
  three renews it), so it adopts no view and declares nobody dead; w1 and w2 hear nothing for
  the lease and its margin, go on in ring mode and, a majority of the last view, commit steps
  without w0; w0 commits nothing during the cut.  At the heal their heartbeats hand their view
  to the coordinator, which takes it over; w0 is back as a newcomer and commits again.

In all, no step is ever committed with two different parameter digests.  Waits are for events
(a log line, records); the cut lasts until the coordinator declared the worker dead, the ring
side went on, or, for the coordinator's cut, three heartbeat timeouts (what the scenario is: a
cut longer than the timeout).  Skipped with the reason where namespaces cannot be made (not root,
no ``ip``).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from flotilla.comm.auth import generate_secret, write_secret_file
from tests.multiproc._jobs import records, training_steps, wait_for

pytestmark = pytest.mark.timeout(300)

PORT = 5556
TIMEOUT_S = 2.0  # cluster.heartbeat_timeout_s


def _start(hosts, tmp: Path, placement: dict[str, int]):
    write_secret_file(tmp / "secret", generate_secret())
    a = hosts[0]
    args = ["coordinator", "examples/tiny.yaml", "--secret-file", str(tmp / "secret"), "--port", str(PORT)]
    args += ["--report", str(tmp / "report"), "--set", f"cluster.host={a.address}"]
    for s in (f"cluster.num_workers={len(placement)}", "job.steps=1000000", "job.eval_every_steps=0"):
        args += ["--set", s]
    args += ["--set", f"cluster.heartbeat_timeout_s={TIMEOUT_S}"]
    log = tmp / "coordinator.log"
    coord = hosts.start(a, args, log)
    wait_for(
        lambda: "coordinator listening on" in log.read_text() or coord.poll() is not None, 60, "listening"
    )
    assert coord.poll() is None, log.read_text()[-3000:]
    workers = {}
    for name, host in placement.items():
        wargs = ["worker", "--coordinator", f"{a.address}:{PORT}", "--secret-file", str(tmp / "secret")]
        workers[name] = hosts.start(hosts[host], [*wargs, "--name", name], tmp / f"{name}.log")
    return coord, workers


def _committed(tmp: Path) -> list[dict]:
    try:
        return [r for r in training_steps(records(tmp / "report")) if r["committed"]]
    except (OSError, ValueError):
        return []


def _cut(hosts, up: bool) -> float:
    a = hosts[0]
    subprocess.run(["ip", "-n", a.netns, "link", "set", hosts._veths[0], "up" if up else "down"], check=True)
    return time.time()


def _finish(tmp: Path, coord, workers) -> dict:
    coord.send_signal(signal.SIGINT)  # (the job is endless: stop it as Ctrl-C does)
    assert coord.wait(timeout=60) == 130, _logs(tmp)  # (interrupted: its summary says so)
    for proc in workers.values():
        proc.wait(timeout=60)
    return json.loads((tmp / "report" / "summary.json").read_text())


def _logs(tmp: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-2500:]}" for p in sorted(tmp.glob("*.log")))


def _one_digest_per_step(committed: list[dict]) -> None:
    by_step: dict[int, set[str]] = {}
    for r in committed:
        by_step.setdefault(r["step"], set()).add(r["digest"])
    split = {s: d for s, d in by_step.items() if len(d) > 1}
    assert not split, f"steps committed with two parameter sets: {sorted(split)[:5]}"


def _commit_times(committed: list[dict], t0: float, name: str) -> list[float]:
    return [t0 + r["time_s"] for r in committed if r["name"] == name]


def _back_within(times: list[float], healed_at: float, name: str, bound_s: float = 10.0) -> None:
    """``name`` committed again within ``bound_s`` of the heal (printed)."""
    after = [t for t in times if t > healed_at]
    assert after, f"{name} never committed after the heal"
    print(f"{name} committed again {after[0] - healed_at:.2f} s after the heal")
    assert after[0] - healed_at <= bound_s, name


def test_a_worker_cut_off_is_left_behind_and_rejoins_after_the_heal(hosts, tmp_path: Path) -> None:
    coord, workers = _start(hosts, tmp_path, {"w0": 0, "w1": 0, "w2": 1})
    log = tmp_path / "coordinator.log"
    try:
        wait_for(lambda: {r["name"] for r in _committed(tmp_path)} == {"w0", "w1", "w2"}, 120, "training")
        first_id = next(r["worker_id"] for r in _committed(tmp_path) if r["name"] == "w2")
        cut_at = _cut(hosts, up=False)
        wait_for(lambda: "(w2) declared dead" in log.read_text(), 60, "w2 declared dead")
        seen = len(_committed(tmp_path))
        wait_for(
            lambda: len(_committed(tmp_path)) > seen + 20, 60, "the majority trains on"
        )  # (during the cut)
        healed_at = _cut(hosts, up=True)
        wait_for(  # (w2 as a newcomer: another worker id)
            lambda: any(r["name"] == "w2" and r["worker_id"] != first_id for r in _committed(tmp_path)),
            60,
            "w2 commits again",
        )
        print(f"\nw2 cut off for {healed_at - cut_at:.1f} s")
    finally:
        summary = _finish(tmp_path, coord, workers)
    committed = _committed(tmp_path)
    _one_digest_per_step(committed)
    t0 = float(summary["t0_unix"])
    for name in ("w0", "w1"):  # the majority side committed during the cut
        assert any(cut_at < t < healed_at for t in _commit_times(committed, t0, name)), name
    back = [t for t in _commit_times(committed, t0, "w2") if t > healed_at]
    assert back, _logs(tmp_path)
    print(f"w2 committed again {back[0] - healed_at:.2f} s after the heal")
    assert back[0] - healed_at <= 10.0
    assert not any(cut_at + 1.0 < t < healed_at for t in _commit_times(committed, t0, "w2"))
    assert "rejoining as a newcomer" in (tmp_path / "w2.log").read_text()


def test_the_coordinator_cut_off_stops_nothing_and_every_worker_reports_after_the_heal(
    hosts, tmp_path: Path
) -> None:
    coord, workers = _start(hosts, tmp_path, {"w0": 1, "w1": 1, "w2": 1})
    try:
        wait_for(lambda: {r["name"] for r in _committed(tmp_path)} == {"w0", "w1", "w2"}, 120, "training")
        cut_at = _cut(hosts, up=False)
        time.sleep(3 * TIMEOUT_S)  # (the scenario: a cut longer than the heartbeat timeout)
        healed_at = _cut(hosts, up=True)
        seen = len(_committed(tmp_path))
        wait_for(
            lambda: {r["name"] for r in _committed(tmp_path)[seen:]} == {"w0", "w1", "w2"}, 60, "reports"
        )
    finally:
        summary = _finish(tmp_path, coord, workers)
    committed = _committed(tmp_path)
    _one_digest_per_step(committed)
    t0 = float(summary["t0_unix"])
    for name in ("w0", "w1", "w2"):
        times = _commit_times(committed, t0, name)
        assert any(cut_at < t < healed_at for t in times), f"{name} did not commit during the cut"
        _back_within(times, healed_at, name)
    assert summary["members_lost"] == [], summary["members_lost"]
    assert "declared dead" not in (tmp_path / "coordinator.log").read_text()


def test_a_coordinator_cut_off_with_a_minority_stops_and_the_majority_goes_on(hosts, tmp_path: Path) -> None:
    coord, workers = _start(hosts, tmp_path, {"w0": 0, "w1": 1, "w2": 1})
    try:
        wait_for(lambda: {r["name"] for r in _committed(tmp_path)} == {"w0", "w1", "w2"}, 120, "training")
        cut_at = _cut(hosts, up=False)
        for name in ("w1", "w2"):
            wait_for(
                lambda n=name: "has lapsed" in (tmp_path / f"{n}.log").read_text(), 60, f"{name} in ring mode"
            )
        wait_for(
            lambda: "ring repair: adopted view" in (tmp_path / "w1.log").read_text(), 60, "the ring's view"
        )
        time.sleep(2 * TIMEOUT_S)  # (the majority trains on: its records wait in its links)
        healed_at = _cut(hosts, up=True)
        seen = len(_committed(tmp_path))
        wait_for(
            lambda: {r["name"] for r in _committed(tmp_path)[seen:]} == {"w0", "w1", "w2"}, 60, "all back"
        )
    finally:
        summary = _finish(tmp_path, coord, workers)
    committed = _committed(tmp_path)
    _one_digest_per_step(committed)
    t0 = float(summary["t0_unix"])
    for name in ("w1", "w2"):  # the majority side committed during the cut, in ring mode
        assert any(cut_at + TIMEOUT_S < t < healed_at for t in _commit_times(committed, t0, name)), name
    # the minority side (with the coordinator) committed nothing once its collectives broke
    assert not any(cut_at + 1.0 < t < healed_at for t in _commit_times(committed, t0, "w0")), _logs(tmp_path)
    for name in ("w0", "w1", "w2"):
        _back_within(_commit_times(committed, t0, name), healed_at, name)
    assert "declared dead" not in (tmp_path / "coordinator.log").read_text()
    lost = {m["name"]: m for m in summary["members_lost"]}  # (the summary says whom and why)
    assert set(lost) == {"w0"} and "cut off from the majority" in lost["w0"]["why"], lost
    assert lost["w0"]["rejoined_as"] is not None, lost
