"""Real processes: children forked by the run's zygote (``launch/zygote.py``) get what ``exec``
gave them -- own session, the request's environment, working directory and import path, output
appended to their log, their exit status (a signal as a negative code), death with the zygote,
draws of their own from Python's, NumPy's and torch's generators -- and the
supervisor falls back to ``exec`` wherever the zygote cannot serve."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flotilla.core.errors import ConfigError
from flotilla.launch.supervisor import Supervisor, child_env
from flotilla.launch.zygote_client import SPAWN_VAR, ForkedProc, Zygote, zygote_wanted

from ._jobs import wait_for

pytestmark = pytest.mark.timeout(180)

PROBE = textwrap.dedent(
    """
    import json, os, random, sys, time
    import numpy, torch
    if sys.argv[1:2] == ["sleep"]:
        time.sleep(600)
    print(json.dumps({
        "name": __name__,
        "pid": os.getpid(),
        "sid": os.getsid(0),
        "cwd": os.getcwd(),
        "argv": sys.argv[1:],
        "mark": os.environ.get("ZYGOTE_TEST_MARK"),
        "launcher_only": os.environ.get("ZYGOTE_TEST_LAUNCHER_ONLY"),
        "stdin": os.readlink("/proc/self/fd/0"),
        "random": random.random(),
        "numpy": float(numpy.random.random()),
        "torch": float(torch.rand(1)),
        "cmdline": open("/proc/self/cmdline", "rb").read().replace(b"\\0", b" ").decode().strip(),
        "fds": sorted(int(f) for f in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{f}")),
    }))
    sys.exit(int(sys.argv[1]) if sys.argv[1:2] and sys.argv[1].isdigit() else 0)
    """
)


@pytest.fixture
def probe(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose PYTHONPATH finds the probe module (as a user's task module is found)."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "zygote_probe.py").write_text(PROBE)
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(mods), env["PYTHONPATH"]])
    env["ZYGOTE_TEST_MARK"] = "child"
    return env, tmp_path


def _zygote(tmp_path: Path, env: dict[str, str]) -> Zygote:
    from flotilla.launch.supervisor import _die_with_parent

    return Zygote(env, tmp_path / "zygote.log", die_with_parent=_die_with_parent)


def _read(log: Path) -> dict:
    return json.loads(log.read_text().strip().splitlines()[-1])


def test_a_forked_child_gets_what_exec_gave_it(probe: tuple[dict[str, str], Path], monkeypatch) -> None:
    env, tmp_path = probe
    monkeypatch.setenv("ZYGOTE_TEST_LAUNCHER_ONLY", "launcher")  # (not in the request's env)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    zygote = _zygote(tmp_path, env)
    try:
        logs = [tmp_path / "a.log", tmp_path / "b.log"]
        logs[0].write_text("kept\n")
        procs = [zygote.spawn([sys.executable, "-m", "zygote_probe", "3", "x"], log, env) for log in logs]
        assert all(isinstance(p, ForkedProc) for p in procs)
        codes = [p.wait(timeout=60) for p in procs if p is not None]
    finally:
        zygote.close()
    assert codes == [3, 3]
    seen = [_read(log) for log in logs]
    assert logs[0].read_text().startswith("kept\n")  # (appended)
    for s, p in zip(seen, procs):
        assert p is not None and s["pid"] == p.pid
        assert s["name"] == "__main__" and s["argv"] == ["3", "x"]
        assert s["sid"] == s["pid"]  # its own session: killpg(pid) reaches all it starts
        assert s["cwd"] == str(work)
        assert s["mark"] == "child" and s["launcher_only"] is None
        assert s["stdin"] == os.devnull
        assert s["fds"] == [0, 1, 2]  # (nothing of the zygote's leaks into it)
        assert s["cmdline"] == f"{sys.executable} -m zygote_probe 3 x"  # (as ps shows an exec'd one)
    assert seen[0]["random"] != seen[1]["random"]
    assert seen[0]["numpy"] != seen[1]["numpy"]
    assert seen[0]["torch"] != seen[1]["torch"]  # (seeded from the OS, as in a fresh interpreter)


def test_signals_timeouts_and_the_zygotes_death(probe: tuple[dict[str, str], Path]) -> None:
    env, tmp_path = probe
    zygote = _zygote(tmp_path, env)
    try:
        first = zygote.spawn([sys.executable, "-m", "zygote_probe", "sleep"], tmp_path / "s1.log", env)
        second = zygote.spawn([sys.executable, "-m", "zygote_probe", "sleep"], tmp_path / "s2.log", env)
        assert first is not None and second is not None
        assert first.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            first.wait(timeout=0.2)
        os.killpg(first.pid, signal.SIGKILL)  # (as kill_all does)
        assert first.wait(timeout=30) == -signal.SIGKILL
        zygote.proc.kill()  # its children die with it and are reported killed
        assert second.wait(timeout=30) == -signal.SIGKILL
        assert zygote.spawn([sys.executable, "-m", "zygote_probe"], tmp_path / "s3.log", env) is None
    finally:
        zygote.close()


def test_a_bad_request_is_answered_and_the_zygote_serves_on(probe: tuple[dict[str, str], Path]) -> None:
    env, tmp_path = probe
    zygote = _zygote(tmp_path, env)
    try:
        assert zygote.spawn([sys.executable, "-m", "zygote_probe"], tmp_path / "ok.log", env) is not None
        zygote._asked += 2  # (answers to requests written here by hand)
        os.write(
            zygote._req_w, b'{"argv": ["python", "-c", "print(1)"], "env": {}, "cwd": "/", "log": "x"}\n'
        )
        os.write(zygote._req_w, b"not json\n")
        wait_for(lambda: len(zygote._replies) == 2, 30, "two error replies")
        assert all("error" in r for r in zygote._replies)
        zygote._replies.clear()
        again = zygote.spawn([sys.executable, "-m", "zygote_probe", "5"], tmp_path / "again.log", env)
        assert again is not None and again.wait(timeout=60) == 5
    finally:
        zygote.close()


def test_the_supervisor_forks_modules_and_execs_the_rest(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    with Supervisor(tmp_path / "run") as sup:
        forked = sup.spawn("m", [sys.executable, "-m", "json.tool", "--help"], role="worker")
        execed = sup.spawn("c", [sys.executable, "-c", "print('hi')"], role="worker")
        assert isinstance(forked.proc, ForkedProc)
        assert isinstance(execed.proc, subprocess.Popen)
        assert forked.proc.wait(timeout=60) == 0 and execed.proc.wait(timeout=60) == 0
        wait_for(lambda: len(sup.reap()) == 0 and all(c.exit_handled for c in sup.children), 30, "reaped")
    assert "usage" in forked.log_path.read_text()
    assert execed.log_path.read_text() == "hi\n"


def test_flotilla_spawn_exec_turns_the_zygote_off_and_a_bad_value_is_named(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv(SPAWN_VAR, "exec")
    (tmp_path / "run").mkdir()
    with Supervisor(tmp_path / "run") as sup:
        child = sup.spawn("m", [sys.executable, "-m", "json.tool", "--help"], role="worker")
        assert isinstance(child.proc, subprocess.Popen)
        child.proc.wait(timeout=60)
    monkeypatch.setenv(SPAWN_VAR, "vfork")
    with pytest.raises(ConfigError, match=SPAWN_VAR):
        zygote_wanted(os.environ)


def test_a_supervisor_dropped_unclosed_ends_its_zygote(tmp_path: Path) -> None:
    import gc

    (tmp_path / "run").mkdir()
    sup = Supervisor(tmp_path / "run")
    assert sup._zygote is None  # (nothing starts before the first child)
    child = sup.spawn("m", [sys.executable, "-m", "json.tool", "--help"], role="worker")
    assert sup._zygote is not None
    zygote = sup._zygote.proc
    assert child.proc.wait(timeout=60) == 0
    del sup, child
    gc.collect()
    assert zygote.wait(timeout=30) == 0


def test_a_preload_that_leaves_a_thread_running_is_refused() -> None:
    code = (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "from flotilla.launch import zygote\n"
        "print(zygote._preload()[1])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "1 Python thread(s) running" in out.stdout


def test_a_run_forks_its_workers_from_its_zygote(tmp_path: Path) -> None:
    from ._jobs import FLOTILLA, ROOT

    run_dir = tmp_path / "run"
    args = ["run", "examples/tiny.yaml", "--set", "job.steps=3", "--run-dir", str(run_dir), "--no-progress"]
    out = subprocess.run(
        [*FLOTILLA, *args, "--log-level", "INFO"], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "start by exec" not in out.stderr  # (the zygote served every child)
    assert (run_dir / "zygote.log").is_file() and "Traceback" not in (run_dir / "zygote.log").read_text()
    for name in ("w0", "w1"):  # (each forked worker trained)
        assert "adopted view" in (run_dir / f"{name}.log").read_text()
