"""``flotilla calibrate`` measures this machine and ``flotilla simulate --calibration`` uses it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from flotilla.cli.main import app

ROOT = Path(__file__).resolve().parents[2]


def test_calibrate_writes_a_profile_the_simulator_reads(tmp_path: Path) -> None:
    out = tmp_path / "cal.json"
    cmd = [sys.executable, "-m", "flotilla.cli.main", "calibrate", "--out", str(out), "--repeats", "5"]
    cmd += ["--sizes", "65536,4194304,16777216"]  # (small ones alone are too noisy to fit here)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fitted: all-reduce link" in proc.stdout
    profile = json.loads(out.read_text())
    assert profile["world_size"] == 2 and len(profile["samples"]["allreduce"]) == 3
    for kind in ("p2p", "msgplane"):  # (the message plane's calls carry each size both ways)
        assert [b for b, _ in profile["samples"][kind]] == [65536, 4194304, 16777216]
    assert all(t > 0 for kind in ("allreduce", "p2p", "msgplane") for _, t in profile["samples"][kind])
    for key in ("allreduce_link", "p2p_link", "msgplane_cost"):
        assert profile[key]["bandwidth_gbps"] > 0 and profile[key]["latency_s"] >= 0
    assert profile["step_overhead_s"] > 0
    args = ["simulate", str(ROOT / "examples" / "demo.yaml"), "--strategies", "allreduce", "--step-s", "0.01"]
    result = CliRunner().invoke(app, [*args, "--calibration", str(out)])
    assert result.exit_code == 0, result.output
    assert "links calibrated (cal.json)" in result.output
    # demo.yaml runs 4 workers here: a profile of 2 processes says so
    assert "calibrated with 2 processes, the job runs 4" in result.output, result.output


def test_a_bad_profile_or_bad_options_are_one_line(tmp_path: Path) -> None:
    junk = tmp_path / "junk.json"
    junk.write_text('{"allreduce_link": {"bandwidth_gbps": -1, "latency_s": 0}}')
    args = ["simulate", str(ROOT / "examples" / "demo.yaml"), "--step-s", "0.01", "--calibration", str(junk)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "error: --calibration:" in result.output, result.output
    result = CliRunner().invoke(app, ["calibrate", "--out", str(tmp_path / "x.json"), "--world-size", "1"])
    assert result.exit_code == 2 and "error: --world-size: must be in [2, 16]" in result.output
    assert not (tmp_path / "x.json").exists()
    result = CliRunner().invoke(app, ["calibrate", "--sizes", "a,b"])
    assert result.exit_code == 2 and "error: --sizes" in result.output
