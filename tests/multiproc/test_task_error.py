"""An exception the task's code raises while a worker trains (a corrupt record, a bug) is not a
lost machine: under ``job.on_error: stop`` (the default) the job stops at once with one line naming
the worker, the exception and the step -- before, another worker given the same batch raised it
too and the job lost its workers one by one -- and under ``lose_worker`` only that worker is lost
and the job trains on without it (an error of that worker's host).  The task raises once in the
whole job: the first process to read the record claims a marker file (``O_EXCL``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ._jobs import ROOT, processes_mentioning, start, stop

pytestmark = pytest.mark.timeout(300)

TASK = """
import os, sys
sys.path.insert(0, {examples!r})
import torch
from task import Spirals


class OnceBad(torch.utils.data.Dataset):
    def __init__(self, inner, marker):
        self.inner, self.marker = inner, marker

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        if index == 1234:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                raise ValueError(f"corrupt record at index {{index}}")
        return self.inner[index]


class Buggy(Spirals):
    def __init__(self, marker, **kwargs):
        super().__init__(**kwargs)
        self.marker = marker

    def train_data(self):
        return OnceBad(self.train, self.marker)
"""


def _run(tmp_path: Path, config: str, on_error: str) -> tuple[int, dict, str]:
    """``flotilla run examples/own_task/<config>.yaml`` on the task above: (exit code, summary, log)."""
    (tmp_path / "buggy.py").write_text(TASK.format(examples=str(ROOT / "examples" / "own_task")))
    marker = tmp_path / "raised"
    sets = {
        "job.task": f"{tmp_path / 'buggy.py'}:Buggy",
        "job.task_args": f"{{marker: {marker}, width: 32, depth: 2, num_samples: 6000}}",
        "job.steps": "300",
        "job.eval_every_steps": "0",
        "job.on_error": on_error,
    }
    report, run, log = tmp_path / "report", tmp_path / "run", tmp_path / "launcher.log"
    args = ["run", f"examples/own_task/{config}.yaml", "--report", str(report), "--run-dir", str(run)]
    args += ["--no-progress", *(x for k, v in sets.items() for x in ("--set", f"{k}={v}"))]
    proc = start(args, log)
    try:
        code = proc.wait(timeout=280)
    finally:
        stop(proc)
    assert marker.exists(), log.read_text()[-3000:]  # (the record was read: the task raised)
    assert processes_mentioning(str(tmp_path)) == []
    return code, json.loads((report / "summary.json").read_text()), log.read_text()


@pytest.mark.parametrize("config", ["allreduce", "ps"])
def test_an_exception_in_the_task_stops_the_job_at_once_naming_it(tmp_path: Path, config: str) -> None:
    code, summary, log = _run(tmp_path, config, "stop")
    assert code != 0 and not summary["completed"], summary
    error = summary["error"]
    assert "raised ValueError: corrupt record at index 1234 at step" in error, error
    assert "job.on_error: stop" in error
    assert f"error: {error}" in log  # (the job's last line)
    # one worker raised; the others did not die one by one after it: they stopped with the job
    assert len(summary["members_lost"]) <= 1, summary["members_lost"]
    assert summary["steps"] < 300


def test_with_lose_worker_the_job_trains_on_without_that_worker(tmp_path: Path) -> None:
    code, summary, log = _run(tmp_path, "allreduce", "lose_worker")
    assert code == 0 and summary["completed"] and summary["steps"] == 300, log[-3000:]
    (lost,) = summary["members_lost"]
    assert "ValueError: corrupt record at index 1234" in lost["why"], lost
