"""Strategy ``diloco`` under ``flotilla run`` (real processes):

- a SIGKILLed worker: the survivors commit their next outer step about as fast as ``allreduce``'s
  survivors commit their next step -- both measured in this test, kill -> next commit, printed --
  and their replicas are bitwise identical after every outer step, no unit applied twice or lost;
- ``--resume`` from a checkpoint equals an uninterrupted run bit for bit, the outer momentum (the
  strategy's own state) included.

Independent of the machine's speed: kills follow observed progress, waits are for events."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flotilla.elastic.checkpoint import list_checkpoints
from tests.multiproc.test_resume import _kill_everything

from ._jobs import interrupt, processes_mentioning, records, start, stop, training_steps, wait_for
from .test_crash_recovery import RECOVERY_BOUND_S, _coordinator_t0_unix

pytestmark = pytest.mark.timeout(600)

H = 4  # inner steps
SURVIVORS = ("w0", "w1")


def _args(tmp: Path, kind: str) -> list[str]:
    strategy = f"{{kind: diloco, inner_steps: {H}}}" if kind == "diloco" else "{kind: allreduce}"
    sets = {
        "cluster.num_workers": "3",
        "cluster.defaults.speed": "0.05",  # steps of a few tens of ms: the kill lands mid-training
        "job.steps": "1000000",  # never reached: the test stops the job
        "job.eval_every_steps": "0",
        "strategy": strategy,
    }
    extra = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    rep, run = str(tmp / f"report-{kind}"), str(tmp / f"run-{kind}")
    return ["run", "examples/tiny.yaml", "--report", rep, "--run-dir", run, "--no-progress", *extra]


def _next_commit(steps: list[dict], name: str, kill_rel_s: float) -> dict | None:
    """``name``'s first commit after its first discarded unit at or after the kill."""
    mine = sorted((r for r in steps if r["name"] == name), key=lambda r: r["time_s"])
    broken = next((r for r in mine if not r["committed"] and r["time_s"] >= kill_rel_s), None)
    if broken is None:
        return None
    return next((r for r in mine if r["committed"] and r["time_s"] > broken["time_s"]), None)


def _kill_one_and_recover(tmp: Path, kind: str) -> tuple[float, list[dict]]:
    """Run 3 workers, SIGKILL w2 mid-run; the seconds from the kill to the survivors' next commit
    (the slower one) and every training record."""
    report, log = tmp / f"report-{kind}", tmp / f"{kind}.log"
    proc = start(_args(tmp, kind), log)
    try:
        wait_for(
            lambda: (
                all(
                    any(r["name"] == n and r["committed"] and r["step"] >= 20 for r in steps)
                    for steps in [training_steps(records(report))]
                    for n in (*SURVIVORS, "w2")
                )
                or proc.poll() is not None
            ),
            120,
            "every worker past step 20",
        )
        assert proc.poll() is None, f"the job ended before the kill: {log.read_text()[-3000:]}"
        t0_unix = _coordinator_t0_unix(tmp / f"run-{kind}")
        victim = next(r["pid"] for r in training_steps(records(report)) if r["name"] == "w2")
        kill_rel_s = time.time() - t0_unix
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: (
                all(_next_commit(training_steps(records(report)), n, kill_rel_s) for n in SURVIVORS)
                or proc.poll() is not None
            ),
            90,
            "the survivors' next commit",
        )
        nxt = {n: _next_commit(training_steps(records(report)), n, kill_rel_s) for n in SURVIVORS}
        assert all(nxt.values()), f"no commit after the kill: {log.read_text()[-3000:]}"
        last = max(int(r["step"]) for r in nxt.values())  # type: ignore[index]
        wait_for(  # the survivors train on as two for a few more units
            lambda: (
                all(
                    sum(1 for r in training_steps(records(report)) if r["name"] == n and r["step"] > last)
                    >= 5
                    for n in SURVIVORS
                )
                or proc.poll() is not None
            ),
            120,
            "five more commits",
        )
        assert proc.poll() is None, f"the job ended early: {log.read_text()[-3000:]}"
        interrupt(proc)
        assert proc.wait(timeout=60) == 130, log.read_text()[-3000:]
    finally:
        stop(proc)
    seconds = max(float(r["time_s"]) for r in nxt.values()) - kill_rel_s  # type: ignore[index]
    return seconds, training_steps(records(report))


def _check_units(steps: list[dict], unit: int) -> None:
    """Each survivor's committed units are consecutive, none twice (a unit another survivor
    committed before the kill broke the vote may be taken over), and the survivors' replicas
    are bitwise identical after every unit both committed."""
    for name in SURVIVORS:
        ends = sorted(r["step"] for r in steps if r["name"] == name and r["committed"])
        assert len(set(ends)) == len(ends), f"{name}: a unit was applied twice"
        others = {r["step"] for r in steps if r["committed"] and r["name"] != name}
        missing = sorted(set(range(unit - 1, ends[-1] + 1, unit)) - set(ends))
        assert set(missing) <= others, f"{name}: units ending at {missing} lost"
        assert all((e + 1) % unit == 0 for e in ends), f"{name}: a unit did not end at a multiple of {unit}"
    digests: dict[int, set[str]] = {}
    for r in steps:
        if r["name"] in SURVIVORS and r["committed"] and "digest" in r:
            digests.setdefault(r["step"], set()).add(r["digest"])
    assert digests and all(len(d) == 1 for d in digests.values()), "the survivors' replicas differ"


@pytest.mark.slow  # (two 3-worker jobs, ~90 s: in `make test-all`)
def test_survivors_of_a_kill_commit_their_next_outer_step_as_fast_as_allreduce(tmp_path: Path) -> None:
    figures = {}
    for kind in ("allreduce", "diloco"):
        figures[kind], steps = _kill_one_and_recover(tmp_path, kind)
        _check_units(steps, H if kind == "diloco" else 1)
    print(f"\nkill -> survivors' next commit: allreduce {figures['allreduce']:.2f} s, "
          f"diloco {figures['diloco']:.2f} s")  # fmt: skip
    assert max(figures.values()) < RECOVERY_BOUND_S, figures


RESUME_CONFIG = """
cluster: {{num_workers: 2}}
job:
  model: {{name: tiny_mlp}}
  dataset: {{name: synthetic, num_samples: 2000}}
  optimizer: {{kind: adam, lr: 0.002}}
  batch_size: 64
  steps: {steps}
  eval_every_steps: 0
strategy: {{kind: diloco, inner_steps: 5, outer_lr: 0.7, outer_momentum: 0.9}}
report: {{digest_every_steps: 0}}
checkpoint: {{every_steps: 10, keep: 2, dir: {ckpt}}}
"""
STEPS = 400


def _newest(ckpt: Path) -> int:
    found = list_checkpoints(ckpt)
    return int(found[-1].name.split("-")[1]) if found else -1


def _run(tmp: Path, name: str, cfg: Path, extra: list[str]):
    run_dir = tmp / f"run-{name}"
    args = ["run", str(cfg), "--no-progress", "--run-dir", str(run_dir), "--report", str(tmp / f"rep-{name}")]
    return start(args + extra, tmp / f"{name}.log"), run_dir


def test_resume_equals_the_uninterrupted_run_bit_for_bit(tmp_path: Path) -> None:
    """The inner optimizer is Adam, each worker's own: every rank's inner state (the strategy's
    local state, beside rank 0's checkpoint) and the outer momentum (its shared state, in the
    checkpoint) must both come back for the resumed run to equal the uninterrupted one."""
    ckpt = tmp_path / "ckpt"
    cfg, ref_cfg = tmp_path / "job.yaml", tmp_path / "ref.yaml"
    cfg.write_text(RESUME_CONFIG.format(steps=STEPS, ckpt=ckpt))
    ref_cfg.write_text(RESUME_CONFIG.format(steps=STEPS, ckpt=tmp_path / "ref-ckpt"))
    proc, _ = _run(tmp_path, "ref", ref_cfg, [])
    assert proc.wait(timeout=300) == 0, (tmp_path / "ref.log").read_text()[-2000:]
    reference = load_file(tmp_path / "rep-ref" / "model.safetensors")

    proc, run_dir = _run(tmp_path, "killed", cfg, [])
    log = tmp_path / "killed.log"
    try:
        wait_for(
            lambda: _newest(ckpt) >= 20 or proc.poll() is not None, 120, "a checkpoint at step >= 20", 0.005
        )
        assert proc.poll() is None, f"the run ended early: {log.read_text()[-2000:]}"
    finally:
        _kill_everything(proc, run_dir, processes_mentioning(str(run_dir)))
    at = _newest(ckpt)
    assert 20 <= at < STEPS, at
    state = load_file(list_checkpoints(ckpt)[-1] / "strategy.safetensors")
    assert any(k.startswith("momentum.") for k in state), sorted(state)
    done = ckpt / "local" / "step-000000010"  # (a later one may miss a rank: the kill)
    local = [load_file(done / f"rank-{r}.safetensors") for r in (0, 1)]
    assert local[0].keys() == local[1].keys() and any(k.endswith("exp_avg") for k in local[0])
    assert not all(torch.equal(local[0][k], local[1][k]) for k in local[0])  # each worker's own

    proc, _ = _run(tmp_path, "resumed", cfg, ["--resume", str(ckpt)])
    assert proc.wait(timeout=300) == 0, (tmp_path / "resumed.log").read_text()[-2000:]
    final = load_file(tmp_path / "rep-resumed" / "model.safetensors")
    resumed = [
        ln for ln in (tmp_path / "run-resumed" / "w0.log").read_text().splitlines() if "resumed from" in ln
    ]
    print(f"\nkilled after the checkpoint of step {at}; {resumed[0].split('INFO ')[-1] if resumed else '?'}")
    assert not any("no local state" in p.read_text() for p in (tmp_path / "run-resumed").glob("w*.log"))
    assert final.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(final[key], value), f"{key} differs from the uninterrupted run"
