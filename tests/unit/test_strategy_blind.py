"""Nothing under ``trainer/``, ``roles/`` or ``launch/`` may branch on a strategy: read its
``traits``, compare its ``kind``, ``getattr`` on it, or ``isinstance`` it against a settings class
(``*Strategy``).  A strategy says what it needs through its spec (``sync/spec.py``).

None is left (``STILL`` is empty; it was a ratchet while there were): the loop's decisions are the
pure loop machine's (``trainer/loop_machine.py``), which reads a strategy's declared terms
(``sync.base.terms_of``), never its traits; the launch and the optimizer read what a strategy
declares (``LaunchNeeds``, ``StrategySettings.servers_apply_optimizer``)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "flotilla"
PACKAGES = ("trainer", "roles", "launch")
STILL: dict[str, int] = {}  # file -> branches on a strategy that remain (none: keep it so)


def _branches(tree: ast.AST) -> int:
    found = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "traits" and isinstance(node.ctx, ast.Load):
            found += 1
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            found += any(isinstance(s, ast.Attribute) and s.attr == "kind" and "strateg" in ast.unparse(s)
                         for s in sides)  # fmt: skip
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = [ast.unparse(a) for a in node.args]
            if node.func.id == "getattr" and args and "strateg" in args[0]:
                found += 1
            if node.func.id == "isinstance" and len(args) == 2 and args[1].endswith("Strategy"):
                found += 1
    return found


def test_trainer_roles_and_launch_do_not_branch_on_a_strategy() -> None:
    seen = Counter()
    for pkg in PACKAGES:
        for path in sorted((SRC / pkg).rglob("*.py")):
            n = _branches(ast.parse(path.read_text()))
            if n:
                seen[str(path.relative_to(SRC))] = n
    assert dict(seen) == STILL, (
        "branches on a strategy outside its spec changed: new ones are not allowed; "
        f"removed ones lower STILL. Now: {dict(seen)}"
    )


def test_the_checker_catches_each_kind_of_branch() -> None:
    code = """
if strategy.traits.barrier: pass
if cfg.strategy.kind == "ps": pass
x = getattr(cfg.strategy, "replication", 1)
if isinstance(cfg.strategy, PSStrategy): pass
print(cfg.strategy.kind)  # reporting the kind is fine
self.traits = Traits(barrier=False)  # a strategy declaring its own is fine
"""
    assert _branches(ast.parse(code)) == 4
