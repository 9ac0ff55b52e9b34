"""The same learning rate trains the same under ``ps`` (update ``delta``, per-worker Adam) as under
``allreduce`` (issue 16): the bundled examples ``examples/own_task/ps.yaml`` (4 workers, 2 shards;
run under BSP here, its straggler at full speed) and ``allreduce.yaml`` (3 workers), both at
lr 0.01, end within 0.02 test accuracy of each other.  Under the old rule (the server added every worker's
Adam step, so a clock moved the weights by up to N steps) the PS run ended at 0.69 where
allreduce reached 1.0 (docs/optimizers.md).

What is compared is the MEDIAN of the evaluations over the last third of the run (steps 400 ...
600, every 50), not the final one: at lr 0.01 a PS run's trajectory is chaotic.  Until issue 37 a
shard added the workers' deltas in the order they arrived and a BSP read could hold part of the
next clock, so two BSP runs differed from the first clocks on and a brief dip landed on any step
(BSP runs are now the same on any machine, ``test_ps_bsp_determinism.py``; the median stays, as
the comparison is about the update rule, not one trajectory).  Eight runs on two cores (eval
every 50 steps) dipped to 0.835-0.961 at one step mid-run and recovered; one CI run's final
evaluation caught such a dip (0.9025 against allreduce's 0.9925).  The old rule's 0.69 was no
dip: it stayed there."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from ._jobs import processes_mentioning, start, stop

pytestmark = pytest.mark.timeout(1300)  # safety nets for a slow machine, not a measure

LR = 0.01  # 3.3x the examples' lr: where summing the workers' steps diverged
EVAL_EVERY = 50
LATE_FROM = 400  # of the examples' 600 steps: five evaluations


def _accuracy(tmp_path: Path, example: str, lr: float, *sets: str) -> float:
    report = tmp_path / example
    args = [
        "run",
        f"examples/own_task/{example}.yaml",
        "--report",
        str(report),
        "--run-dir",
        str(tmp_path / f"run-{example}"),
        "--no-progress",
        "--set",
        f"job.optimizer.lr={lr}",
        "--set",
        "checkpoint=null",
        "--set",
        f"job.eval_every_steps={EVAL_EVERY}",
        *(a for kv in sets for a in ("--set", kv)),
    ]
    log = tmp_path / f"{example}.log"
    proc = start(args, log)
    try:
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        stop(proc)
    summary = json.loads((report / "summary.json").read_text())
    assert summary["completed"], summary
    late = [float(e["test_accuracy"]) for e in summary["evals"] if e["step"] >= LATE_FROM]
    assert len(late) == 5, summary["evals"]
    return statistics.median(late)


@pytest.mark.parametrize(
    ("lr", "ps_sets"),
    [
        # BSP: the update rule alone (SSP adds staleness, whose effect depends on the machine's
        # timing: on one core the example's SSP(3) run ended at 0.88 at lr 0.01, on two at 0.99-1.0)
        # Its straggler runs at full speed: under BSP the slowest worker paces every clock and the
        # update rule does not depend on it (the straggler made this the suite's slowest test)
        (LR, ("strategy.consistency={kind: bsp}", "cluster.workers.3.speed=1.0")),
        # the examples exactly as shipped (SSP(3), their own learning rate): -m slow, 45 s
        pytest.param(0.003, (), marks=pytest.mark.slow),
    ],
)
def test_ps_and_allreduce_reach_the_same_accuracy_at_the_same_learning_rate(
    tmp_path: Path, lr: float, ps_sets: tuple[str, ...]
) -> None:
    ps = _accuracy(tmp_path, "ps", lr, *ps_sets)
    allreduce = _accuracy(tmp_path, "allreduce", lr)
    print(f"lr={lr}: ps late median={ps:.4f} allreduce late median={allreduce:.4f}")
    assert allreduce >= 0.95, allreduce
    assert abs(ps - allreduce) <= 0.02, (ps, allreduce)
    assert processes_mentioning(str(tmp_path)) == []
