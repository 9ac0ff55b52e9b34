"""A pipeline job whose stages are started by hand: ``flotilla coordinator`` hosts it, each stage is
a ``flotilla worker`` naming the stage it runs (``roles/stage_host.py``, ``roles/stage_worker.py``).

- The stages train exactly as ``flotilla run`` trains them (the same losses step by step, the
  same final evaluation); a worker naming an unknown stage, a stage index out of range, or a stage
  another worker holds is refused with one line and exits 2, and the job goes on.
- A stage SIGKILLed mid-run ends the job: the coordinator exits 1 naming that stage, the summary
  says ``completed: false``, and the other stage is told to stop.
- With two pipeline instances, a stage SIGKILLed mid-run drops its instance (the other trains
  on); the same workers started again take the lost instance's stage processes, and the instance
  comes back with the running one's state: both end identical, with single-process losses.

Every process is started by the test and killed in its teardown; waits are for events.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from flotilla.comm.auth import generate_secret, write_secret_file
from flotilla.config import load_config
from flotilla.launch.pipeline import run_pipeline_job
from flotilla.trainer.reference import train_single_process
from tests.multiproc._jobs import processes_mentioning, records, start, stop, wait_for
from tests.multiproc._pipeline_job import CONFIG, pipeline_cfg

pytestmark = pytest.mark.timeout(240)


def last_stage_losses(report: Path) -> dict[int, float]:
    """The last stage's training loss of every step (``metrics.jsonl``)."""
    recs = records(report)
    return {r["step"]: r["loss"] for r in recs if r.get("stage_idx") == 1 and r["loss"] is not None}


class Hosted:
    """A coordinator on 127.0.0.1 and the stage workers a test starts; all killed at the end."""

    def __init__(self, tmp: Path, *sets: str, config: str = CONFIG, extra: tuple[str, ...] = ()) -> None:
        self.tmp = tmp
        (tmp / "pipe.yaml").write_text(config)
        write_secret_file(tmp / "secret", generate_secret())
        args = ["coordinator", str(tmp / "pipe.yaml"), "--secret-file", str(tmp / "secret"), "--port", "0"]
        args += ["--report", str(tmp / "report"), *(x for kv in sets for x in ("--set", kv)), *extra]
        self.coordinator = start(args, tmp / "coordinator.log")
        self.procs = [self.coordinator]
        up = lambda: "listening on" in self.log() or self.coordinator.poll() is not None
        wait_for(up, 120, "listening")
        assert self.coordinator.poll() is None, self.log()
        self.address = self.log().split("listening on ", 1)[1].split()[0]

    def log(self, name: str = "coordinator") -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def worker(self, log: str, *args: str, env: dict | None = None):
        base = ["worker", "--coordinator", self.address, "--secret-file", str(self.tmp / "secret")]
        proc = start([*base, *args], self.tmp / f"{log}.log", env=env)
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob("*.log")))

    def close(self) -> None:
        for p in self.procs:
            stop(p)


@pytest.fixture
def hosted(tmp_path):
    made: list[Hosted] = []
    yield lambda *sets, config=CONFIG: made.append(Hosted(tmp_path, *sets, config=config)) or made[-1]
    for h in made:
        h.close()


def test_stages_started_by_hand_train_as_flotilla_run_does_and_bad_claims_are_refused(hosted, tmp_path):
    h = hosted()
    unknown = h.worker("unknown", "--name", "nobody")
    out_of_range = h.worker("range", "--stage", "7")
    fast = h.worker("fast", "--name", "fast")
    assert unknown.wait(timeout=120) == 2 and out_of_range.wait(timeout=120) == 2, h.logs()
    assert (
        "error: worker 'nobody' is not a stage of this job: the stage processes are fast (stage 0 of "
        "instance 0), slow (stage 1 of instance 0)" in h.log("unknown")
    ), h.log("unknown")
    assert "error: stage index 7 is not in this job: its pipelines have 2 stage(s)" in h.log("range")
    wait_for(lambda: "fast (stage 0 of instance 0) joined" in h.log() or fast.poll() is not None, 120, "join")
    twice = h.worker("twice", "--name", "fast")  # (fast holds stage 0, waiting for stage 1)
    assert twice.wait(timeout=120) == 2, h.logs()
    assert "fast (stage 0 of instance 0) is already claimed by the worker with pid" in h.log("twice")
    assert "two workers cannot run one stage" in h.log("twice")
    slow = h.worker("slow", "--stage", "1", "--instance", "0")
    codes = [p.wait(timeout=180) for p in (h.coordinator, fast, slow)]
    assert codes == [0, 0, 0], h.logs()
    assert processes_mentioning(str(tmp_path)) == []
    hosted_summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert hosted_summary["completed"] and set(hosted_summary["hosts"]) == {"fast", "slow"}
    assert (tmp_path / "report" / "model.safetensors").is_file()

    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    reference = run_pipeline_job(pipeline_cfg(ref_dir), ref_dir / "report", ref_dir / "run", progress=False)
    want, got = last_stage_losses(ref_dir / "report"), last_stage_losses(tmp_path / "report")
    assert sorted(got) == list(range(1, 9)) and got == pytest.approx(want, abs=1e-6), (got, want)
    final, ref_final = hosted_summary["evals"][-1], reference["evals"][-1]
    assert final["test_loss"] == pytest.approx(ref_final["test_loss"], abs=1e-6)
    assert hosted_summary["steps"] == reference["steps"] == 8


def test_a_killed_stage_ends_the_hosted_job_naming_it(hosted, tmp_path):
    h = hosted("job.steps=400", "job.eval_every_steps=0")
    fast = h.worker("fast", "--name", "fast")
    slow = h.worker("slow", "--name", "slow")
    trained = lambda: len(last_stage_losses(tmp_path / "report")) >= 3 or slow.poll() is not None
    wait_for(trained, 120, "steps")
    assert slow.poll() is None, h.logs()
    os.kill(slow.pid, signal.SIGKILL)
    t0 = time.monotonic()
    assert h.coordinator.wait(timeout=120) == 1, h.logs()
    assert fast.wait(timeout=60) != 0
    print(f"\nhosted pipeline: job ended {time.monotonic() - t0:.2f} s after stage 1 was killed")
    line = [x for x in h.log().splitlines() if x.startswith("error:")]
    assert line and "pipeline stage slow (stage 1 of instance 0)" in line[-1], h.log()
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["completed"] is False and "slow (stage 1 of instance 0)" in summary["error"]
    assert processes_mentioning(str(tmp_path)) == []


REPLICAS = """
cluster:
  workers: [{name: a0, memory_bytes: 64MiB}, {name: a1, speed: 0.5, memory_bytes: 64MiB},
            {name: b0, memory_bytes: 64MiB}, {name: b1, speed: 0.5, memory_bytes: 64MiB}]
job:
  model: {name: char_transformer, width: 32}
  dataset: {name: pysource, num_samples: 600, test_fraction: 0.2}
  optimizer: {kind: adam, lr: 0.003}
  batch_size: 16
  steps: 8
  eval_every_steps: 4
strategy:
  {kind: pipeline, schedule: 1f1b, num_stages: 2, num_microbatches: 2, replicas: 2, step_timeout_s: 20}
"""


def _losses_and_reference(tmp_path: Path) -> tuple[dict, dict]:
    """Every last stage's loss by (stage, step) of the hosted run in ``tmp_path`` and of the same
    job run by ``flotilla run``'s launcher."""
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "dp.yaml").write_text(REPLICAS)
    run_pipeline_job(load_config(ref / "dp.yaml", []), ref / "report", ref / "run", progress=False)
    got = {(r["name"], r["step"]): r["loss"] for r in records(tmp_path / "report") if r["loss"] is not None}
    want = {(r["name"], r["step"]): r["loss"] for r in records(ref / "report") if r["loss"] is not None}
    return got, want


@pytest.mark.slow  # (four stage processes and a reference run: about a minute on 2 cores)
def test_two_pipeline_instances_started_by_hand_stay_identical_and_train_as_flotilla_run(hosted, tmp_path):
    h = hosted(config=REPLICAS)
    workers = [h.worker(n, "--name", n) for n in ("a0", "a1", "b0", "b1")]
    assert [p.wait(timeout=200) for p in (h.coordinator, *workers)] == [0] * 5, h.logs()
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["completed"] and summary["replicas"] == 2 and summary["replicas_identical"] is True
    assert set(summary["hosts"]) == {"a0", "a1", "b0", "b1"}

    got, want = _losses_and_reference(tmp_path)
    assert len(want) == 16 and got == pytest.approx(want, abs=1e-6)  # (both instances' last stages)


@pytest.mark.slow  # (four stage processes and a reference run: about a minute on 2 cores)
def test_hosted_instances_regroup_after_the_network_breaks_their_groups(hosted, tmp_path):
    """Collective resets (``comm/faulty.py``) on stages started by hand: a stage that finds its
    group broken says so, the coordinator announces the same instances again once no stage was
    lost within the grace (``HostedInstances._regroup``), everyone re-forms: nothing lost, the
    losses of the run without resets."""
    from flotilla.comm.faulty import ENV_VAR, NetFaults

    h = hosted(config=REPLICAS)
    env = {ENV_VAR: NetFaults(collective_reset=0.01, seed=1).to_json()}
    workers = [h.worker(n, "--name", n, env=env) for n in ("a0", "a1", "b0", "b1")]
    assert [p.wait(timeout=200) for p in (h.coordinator, *workers)] == [0] * 5, h.logs()
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["completed"] and summary["instances_lost"] == [] and summary["instances_regrouped"]
    assert summary["replicas_identical"] is True
    got, want = _losses_and_reference(tmp_path)
    assert len(want) == 16 and {k: want[k] for k in got} == pytest.approx(got, abs=1e-6)
    # (a step one instance discarded and the other applied: the regroup's state agreement rolled
    # the first forward, so its last stage recorded no loss for it -- the other instance did)
    other = {"a1": "b1", "b1": "a1"}
    assert all((other[n], step) in got for n, step in set(want) - set(got))


@pytest.mark.slow  # (four stage processes: about 40 s on 2 cores)
def test_a_hosted_instance_losing_a_stage_is_dropped_and_the_other_trains_on(hosted, tmp_path):
    h = hosted("job.steps=60", "job.eval_every_steps=0", config=REPLICAS)
    procs = {n: h.worker(n, "--name", n) for n in ("a0", "a1", "b0", "b1")}
    report = tmp_path / "report"
    trained = lambda: sum(r["name"] == "b1" and r["loss"] is not None for r in records(report)) >= 3
    wait_for(lambda: trained() or procs["b1"].poll() is not None, 120, "steps")
    assert procs["b1"].poll() is None, h.logs()
    os.kill(procs["b1"].pid, signal.SIGKILL)
    killed_at = time.time()
    assert h.coordinator.wait(timeout=180) == 0, h.logs()
    assert procs["a0"].wait(timeout=60) == 0 and procs["a1"].wait(timeout=60) == 0, h.logs()
    procs["b0"].wait(timeout=60)  # (told to stop, or out of the job on the next generation)
    assert "pipeline instance 1 lost" in h.log("b0") or "instance is out of the job" in h.log("b0")
    summary = json.loads((report / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 60
    (lost,) = summary["instances_lost"]
    assert lost["instance"] == 1 and lost["survivors"] == [0] and "b1" in lost["reason"]
    assert "lost pipeline instance 1" in summary["degraded"]
    a1 = sorted(r["step"] for r in records(report) if r["name"] == "a1" and r["loss"] is not None)
    assert a1 == list(range(1, 61))  # (instance 0 trained every step, once)
    times = sorted(r["time_s"] for r in records(report) if r["name"] == "a1")
    after = [t for t in times if t > killed_at]
    gap = max(b - a for a, b in zip([killed_at, *after], after))
    print(f"\nhosted instance lost: found {lost['at'] - killed_at:.2f} s after the kill; the survivors' "
          f"longest step gap after it {gap:.2f} s")  # fmt: skip


@pytest.mark.slow  # (six stage processes over 600 steps: 35 s alone, ~57 s inside the suite on 2 cores)
def test_a_lost_hosted_instance_comes_back_when_its_stages_are_started_again(hosted, tmp_path):
    """Hosted, nobody but the user starts processes: the lost instance's stage processes are free
    at once, the workers started again take them, and the instance comes back with the state."""
    slow = ("cluster.workers.1.speed=0.25", "cluster.workers.3.speed=0.25")  # (the run outlasts a start)
    sets = ("job.steps=600", "job.eval_every_steps=0", *slow)  # (~5 s for the newcomers' start here)
    h = hosted(*sets, config=REPLICAS)
    procs = {n: h.worker(n, "--name", n) for n in ("a0", "a1", "b0", "b1")}
    report = tmp_path / "report"
    trained = lambda: sum(r["name"] == "b1" and r["loss"] is not None for r in records(report)) >= 5
    wait_for(lambda: trained() or procs["b1"].poll() is not None, 120, "steps")
    assert procs["b1"].poll() is None, h.logs()
    os.kill(procs["b1"].pid, signal.SIGKILL)
    killed_at = time.time()
    wait_for(lambda: "comes back once its stages join again" in h.log(), 60, "the loss")
    assert "flotilla worker --name b0 / b1" in h.log()
    procs["b0"].wait(timeout=60)  # (told to stop in a beat, or out of the job on the next generation)
    assert "pipeline instance 1 lost" in h.log("b0") or "instance is out of the job" in h.log("b0")
    again = {n: h.worker(f"{n}.again", "--name", n) for n in ("b0", "b1")}
    assert h.coordinator.wait(timeout=200) == 0, h.logs()
    assert [p.wait(timeout=60) for p in (procs["a0"], procs["a1"], *again.values())] == [0] * 4, h.logs()

    summary = json.loads((report / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 600 and summary["restarts"] == []
    assert [(e["instance"], e["stage"]) for e in summary["instances_lost"]] == [(1, "b1")]
    back = summary["instances_back"]
    assert [(e["instance"], e["instances"]) for e in back] == [(1, [0, 1])], h.log()
    assert "back: instance(s) 1" in summary["degraded"]
    assert summary["replicas_identical"] is True  # (the newcomers received the state and kept in step)
    (tmp_path / "ref.yaml").write_text(REPLICAS)
    reference = train_single_process(load_config(tmp_path / "ref.yaml", list(sets)))
    assert summary["train_losses"] == pytest.approx(reference, rel=1e-4)
    a1 = sorted(r["step"] for r in records(report) if r["name"] == "a1" and r["loss"] is not None)
    assert a1 == list(range(1, 601))  # (the lead's last stage: every step once)
    b1 = sorted(r["step"] for r in records(report) if r["name"] == "b1" and r["loss"] is not None)
    assert b1[-1] == 600 and back[0]["reached_step"] < 600  # (the newcomer trained to the end)
    print(f"\nhosted: b1 killed, instance 1 back {back[0]['at'] - killed_at:.2f} s later (its workers "
          f"started by the test once the loss was logged), at step {back[0]['reached_step']}")  # fmt: skip


def test_a_stage_whose_task_raises_ends_the_hosted_job_even_with_another_instance(hosted, tmp_path):
    """``job.on_error: stop`` (the default): one stage process of two pipeline instances raises
    (its task's last layer, once in the job): not a lost instance the other trains on without --
    the coordinator ends the job naming it."""
    tasks = Path(__file__).with_name("_gallery_tasks.py")
    marker = tmp_path / "raised"
    config = f"""
cluster:
  workers: [{{name: a0}}, {{name: a1}}, {{name: b0}}, {{name: b1}}]
job:
  task: "{tasks}:FailsOnceInTheHead"
  task_args: {{marker: "{marker}"}}
  optimizer: {{kind: sgd, lr: 0.05}}
  batch_size: 32
  steps: 40
  eval_every_steps: 0
strategy:
  {{kind: pipeline, schedule: 1f1b, num_stages: 2, num_microbatches: 2, replicas: 2, step_timeout_s: 20}}
"""
    h = hosted(config=config)
    workers = [h.worker(n, "--name", n) for n in ("a0", "a1", "b0", "b1")]
    assert h.coordinator.wait(timeout=200) == 1, h.logs()
    assert marker.exists()
    line = [x for x in h.log().splitlines() if x.startswith("error:")]
    assert line and "RuntimeError: boom once in the last layer" in line[-1], h.log()
    assert "job.on_error: stop" in line[-1]
    for w in workers:  # (each ends: told to stop, or its group broke)
        w.wait(timeout=60)
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["completed"] is False and "boom once" in summary["error"], summary
    assert summary["instances_lost"] == [], summary["instances_lost"]  # (no instance was given up)
    assert processes_mentioning(str(tmp_path)) == []
