"""Architecture rules of DESIGN.md, checked on the source (AST) and by importing modules in a fresh
interpreter (transitively: what ``sys.modules`` holds afterwards).

- only ``flotilla.comm`` imports ``torch.distributed`` or ``zmq``;
- a layer imports only itself and the layers below it; packages of equal rank do not import each
  other -- checked directly (AST) and transitively (import every module of a package in a
  subprocess, then no module of a higher or equal-rank sibling package may be loaded);
- pure planning modules import no torch, no sockets/threads, and never read the wall clock --
  directly (AST) and transitively (no torch, zmq, threading, socket, ... in ``sys.modules``);
- ``flotilla.sim`` (when it exists) loads no torch;
- no pickle / cloudpickle / unsafe ``torch.load`` / object collectives anywhere in the package.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "flotilla"

# bottom to top; a package may import packages of a lower or equal rank only
LAYERS = {
    "core": 0,
    "comm": 1,
    "data": 1,
    "models": 1,
    "cluster": 2,
    "ps": 3,
    "pipeline": 3,
    "sync": 4,
    "report": 4,
    "hetpipe": 5,
    "elastic": 5,
    "config": 6,
    "trainer": 7,
    "sim": 8,  # (beside roles, DESIGN.md: it drives the trainer's loop machine, never a role)
    "roles": 8,
    "launch": 9,
    "cli": 10,
}

PURE = [
    "core/events.py",
    "core/checks.py",
    "cluster/membership.py",
    "cluster/rendezvous.py",
    "cluster/rendezvous_state.py",
    "cluster/rendezvous_events.py",
    "cluster/rendezvous_draft.py",
    "cluster/lease.py",
    "cluster/failure.py",
    "cluster/spec.py",
    "cluster/link_costs.py",
    "ps/config.py",
    "ps/clock_rules.py",
    "ps/read_rules.py",
    "sync/plan.py",
    "sync/pr_plan.py",
    "sync/pr_mixing.py",
    "sync/adpsgd_plan.py",
    "ps/two_phase.py",
    "pipeline/stash_plan.py",
    "pipeline/replicas.py",
    "pipeline/layout.py",
    "pipeline/stage_claims.py",
    "pipeline/vw_placement.py",
    "pipeline/vw_report.py",
    "report/clock_spread.py",
    "data/sampler.py",
    "ps/sharding.py",
    "ps/consistency.py",
    "ps/wsp.py",
    "pipeline/profile.py",
    "pipeline/plan.py",
    "pipeline/partition.py",
    "pipeline/fixed_split.py",
    "pipeline/schedule.py",
    "pipeline/validate.py",
    "pipeline/timeline.py",
    "trainer/boundary.py",
    "trainer/loop_machine.py",
    "trainer/loop_state.py",
    "trainer/loop_events.py",
    "cluster/switch_announce.py",
    "cluster/adaptive_policy.py",
    "ps/lr_schedule.py",
    "cluster/launch_plan.py",
    "cluster/gpu_placement.py",
    "report/headline.py",
    "cluster/peer_watch.py",
    "cluster/revocations.py",
    "cluster/revocation_trace.py",
    "cluster/ring_repair.py",
    "cluster/ring_repair_messages.py",
    "cluster/ring_repair_rounds.py",
    "cli/scheduler_env.py",
    "report/chaos_check.py",
    "cluster/comm_cost.py",
    "sim/model.py",
    "sim/members.py",
    "sim/vote.py",
    "sim/pipeline.py",
    "sim/pipeline_costs.py",
    "sim/ps.py",
    "sim/trace.py",
    "sim/partial_reduce.py",
    "sim/pr_spec.py",
    "sim/adpsgd.py",
    "sim/adpsgd_join.py",
    "sim/hetpipe.py",
    "sim/hetpipe_place.py",
    "sim/hetpipe_spec.py",
    "sim/catalog.py",
    "sim/schedule.py",
    "sim/adaptive.py",
    "sim/adaptive_view.py",
]
OBJECT_COLLECTIVES = {
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "all_to_all_object",
}
IMPURE_MODULES = {
    "torch",
    "socket",
    "zmq",
    "threading",
    "multiprocessing",
    "subprocess",
    "asyncio",
    "time",
    "datetime",
}


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py"))


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def _package(path: Path) -> str | None:
    rel = path.relative_to(SRC).parts
    return rel[0] if len(rel) > 1 else None


def test_rules_see_the_whole_package() -> None:
    assert len(_modules()) > 30  # guard against a checker that silently checks nothing
    assert {_package(p) for p in _modules()} - {None} <= set(LAYERS)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_only_comm_touches_the_planes(path: Path) -> None:
    if _package(path) == "comm":
        return
    bad = [
        n
        for n in _imports(path)
        if n == "zmq"
        or n.startswith("zmq.")
        or n == "torch.distributed"
        or n.startswith("torch.distributed.")
    ]
    assert not bad, f"{path.relative_to(SRC)} imports {bad}: only flotilla.comm may"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_layers_import_downwards_only(path: Path) -> None:
    pkg = _package(path)
    if pkg is None:
        return
    for name in _imports(path):
        parts = name.split(".")
        if parts[0] != "flotilla" or len(parts) < 2 or parts[1] not in LAYERS:
            continue
        assert LAYERS[parts[1]] <= LAYERS[pkg], (
            f"{path.relative_to(SRC)} ({pkg}, layer {LAYERS[pkg]}) imports {name} (layer {LAYERS[parts[1]]})"
        )


@pytest.mark.parametrize("rel", PURE)
def test_pure_modules_do_no_io_and_read_no_clock(rel: str) -> None:
    path = SRC / rel
    assert path.exists(), rel
    bad = [n for n in _imports(path) if n.split(".")[0] in IMPURE_MODULES]
    assert not bad, f"{rel} is pure planning code but imports {bad}"
    text = path.read_text()
    assert "open(" not in text, f"{rel} does file I/O"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_pickle_or_unsafe_loading(path: Path) -> None:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            assert not any(m.split(".")[0] in ("pickle", "cloudpickle", "dill") for m in mods), (
                f"{path.name} imports a pickle module"
            )
        if isinstance(node, ast.Call):
            fn = ast.unparse(node.func)
            if fn.endswith("torch.load"):
                kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
                assert kw.get("weights_only") == "True", f"{path.name}: {fn} without weights_only=True"
            assert fn.rsplit(".", 1)[-1] not in OBJECT_COLLECTIVES, f"{path.name}: object collective {fn}"
            assert "allow_pickle=True" not in ast.unparse(node), f"{path.name}: allow_pickle=True"


def test_the_checker_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import zmq\nfrom torch.distributed import TCPStore\nimport pickle\n")
    names = _imports(bad)
    assert "zmq" in names and "torch.distributed" in names and "pickle" in names


# ------------------------------------------------------------------ transitive checks (subprocess)

TRANSITIVE_IMPURE = ("torch", "zmq", "threading", "socket", "multiprocessing", "subprocess", "asyncio")


def _loaded_after_import(modules: list[str]) -> set[str]:
    """``sys.modules`` keys after importing ``modules`` in a fresh interpreter."""
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _dotted(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@pytest.mark.parametrize("rel", PURE)
def test_pure_modules_load_nothing_impure_transitively(rel: str) -> None:
    loaded = _loaded_after_import([_dotted(SRC / rel)])
    bad = sorted(m for m in loaded if m.split(".")[0] in TRANSITIVE_IMPURE)
    assert not bad, f"importing {rel} loads {bad} (a pure module may not, even through other modules)"


def _packages() -> list[str]:
    return sorted({p for p in (_package(m) for m in _modules()) if p is not None})


@pytest.mark.parametrize("pkg", _packages())
def test_packages_load_no_higher_or_sibling_package(pkg: str) -> None:
    """Importing every module of ``pkg`` loads no package of a higher rank and no other package
    of the same rank (equal-rank packages are independent: DESIGN.md §3)."""
    modules = [_dotted(m) for m in _modules() if _package(m) == pkg]
    loaded = _loaded_after_import(modules)
    rank = LAYERS[pkg]
    bad = sorted(
        m
        for m in loaded
        if m.startswith("flotilla.")
        and m.split(".")[1] in LAYERS
        and m.split(".")[1] != pkg
        and LAYERS[m.split(".")[1]] >= rank
    )
    assert not bad, f"importing flotilla.{pkg} (rank {rank}) loads {bad}"


def test_sim_loads_no_torch() -> None:
    if not (SRC / "sim").exists():
        pytest.skip("flotilla.sim does not exist yet")
    loaded = _loaded_after_import([_dotted(m) for m in _modules() if _package(m) == "sim"])
    assert "torch" not in loaded


def test_the_transitive_checker_sees_indirect_imports() -> None:
    # flotilla.comm.collective imports torch.distributed: the subprocess check must see torch
    assert "torch" in _loaded_after_import(["flotilla.comm.collective"])
