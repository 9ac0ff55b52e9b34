"""``examples/cluster/``: the SLURM batch script and the Kubernetes manifest are valid (shell
syntax; YAML objects with the fields Kubernetes requires; the job configuration validates), and
every flotilla option they use exists, so a scheduler user's first run does not fail on a typo."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import typer.main
import yaml

from flotilla.cli.main import app
from flotilla.config import load_config

CLUSTER = Path(__file__).resolve().parents[2] / "examples" / "cluster"


def _options(command: str) -> set[str]:
    click_cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return {opt for p in click_cmd.params for opt in getattr(p, "opts", [])}


def _check_invocation(words: list[str]) -> None:
    assert words[0] == "flotilla", words
    used = {w.split("=")[0] for w in words[2:] if w.startswith("--")}
    unknown = used - _options(words[1])
    assert not unknown, f"flotilla {words[1]}: no such options {sorted(unknown)}"


def test_slurm_script_is_valid_shell_and_uses_existing_options():
    script = CLUSTER / "slurm.sbatch"
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text = script.read_text().replace("\\\n", " ")
    calls = [m.group(0) for m in re.finditer(r"flotilla (coordinator|worker)[^\n&]*", text)]
    assert {c.split()[1] for c in calls} == {"coordinator", "worker"}
    for call in calls:
        _check_invocation(shlex.split(call))
    assert "--coordinator" not in text and "--name" not in text  # both come from srun's environment


def test_kubernetes_manifest_objects_are_complete_and_consistent():
    docs = [d for d in yaml.safe_load_all((CLUSTER / "kubernetes.yaml").read_text()) if d]
    for d in docs:
        assert d.get("apiVersion") and d.get("kind") and d["metadata"].get("name"), d
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    config = by_kind[("ConfigMap", "flotilla-config")]["data"]["job.yaml"]
    cfg = load_config(text=config)  # the job configuration validates
    service = by_kind[("Service", "flotilla-coordinator")]
    assert service["spec"]["clusterIP"] == "None"  # headless: the store's port is reachable too
    coordinator = by_kind[("Job", "flotilla-coordinator")]["spec"]["template"]
    assert service["spec"]["selector"].items() <= coordinator["metadata"]["labels"].items()
    workers = by_kind[("Job", "flotilla-workers")]["spec"]
    assert workers["completionMode"] == "Indexed"  # names w<JOB_COMPLETION_INDEX>
    assert workers["completions"] == workers["parallelism"] == cfg.cluster.effective_num_workers()
    (coord_container,) = coordinator["spec"]["containers"]
    (worker_container,) = workers["template"]["spec"]["containers"]
    _check_invocation(coord_container["command"])
    _check_invocation(worker_container["command"])
    env = {e["name"]: e["value"] for e in worker_container["env"]}
    host, port = env["FLOTILLA_COORDINATOR"].rsplit(":", 1)
    assert host == service["metadata"]["name"]
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    cmd = coord_container["command"]
    assert cmd[cmd.index("--port") + 1] == port
    assert cfg.cluster.host == "0.0.0.0"  # the pod's address is not known in advance
