"""Intra-op threads per process follow the cores available (core/threads.py), and the launcher
tells its children how many compute processes share this machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flotilla.config import load_config
from flotilla.core.errors import ConfigError
from flotilla.core.threads import ENV_VAR, LOCAL_PROCS_VAR, thread_count, usable_cores, use_torch_threads
from flotilla.launch.local import local_compute_procs
from flotilla.launch.supervisor import child_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("env", "cores", "expected"),
    [
        ({}, 16, 1),  # started by hand: one thread, whatever the machine
        ({LOCAL_PROCS_VAR: "2"}, 16, 8),
        ({LOCAL_PROCS_VAR: "3"}, 16, 5),
        ({LOCAL_PROCS_VAR: "1"}, 2, 2),
        ({LOCAL_PROCS_VAR: "4"}, 2, 1),  # more processes than cores: never 0
        ({LOCAL_PROCS_VAR: "2", ENV_VAR: "3"}, 16, 3),  # the explicit setting wins
        ({ENV_VAR: "4"}, 1, 4),
    ],
)
def test_threads_are_the_cores_shared_by_the_local_processes(env: dict, cores: int, expected: int) -> None:
    assert thread_count(env, cores) == expected


@pytest.mark.parametrize("name", [ENV_VAR, LOCAL_PROCS_VAR])
@pytest.mark.parametrize("raw", ["0", "-1", "two", ""])
def test_a_bad_setting_names_the_variable(name: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=f"{name} must be an integer >= 1, got {raw!r}"):
        thread_count({name: raw}, 4)


def test_use_torch_threads_applies_it(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv(LOCAL_PROCS_VAR, "1")
    try:
        assert use_torch_threads() == usable_cores() == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_children_are_told_how_many_compute_processes_the_run_starts() -> None:
    assert child_env(5)[LOCAL_PROCS_VAR] == "5"
    tiny = load_config(ROOT / "examples/tiny.yaml")
    assert local_compute_procs(tiny) == 2
    ps = load_config(ROOT / "examples/own_task/ps.yaml")
    assert local_compute_procs(ps) == 4 + 2  # four workers and two server shards
    pipeline = load_config(ROOT / "examples/own_task/pipeline.yaml")
    assert local_compute_procs(pipeline) == 2
