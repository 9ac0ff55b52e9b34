"""The strategy registry as the configuration's strategy union: registered kinds, import names and
their one-line errors, a spec's check at validation, and the launch needs it declares."""

from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.cluster.launch_plan import Runner
from flotilla.config import load_config
from flotilla.core.errors import ConfigError
from flotilla.sync import registry
from flotilla.sync.spec import RunFacts, StrategySettings, StrategySpec, settings_error

TINY = "examples/tiny.yaml"
STRATEGY = """
from pydantic import Field
from flotilla import StrategySettings, StrategySpec

class Settings(StrategySettings):
    width: int = Field(default=2, ge=1)

def check(settings, facts):
    from flotilla.sync.spec import settings_error
    if settings.width > facts.num_workers:
        n = facts.num_workers
        raise settings_error("width", f"must be <= the number of workers ({n}), got {settings.width}")

SPEC = StrategySpec(kind="mine", settings=Settings, check=check, build=lambda *a: None, summary="a test")
NOT_A_SPEC = 3
"""


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    return str(err.value)


@pytest.fixture
def strategy_file(tmp_path: Path) -> Path:
    path = tmp_path / "mine.py"
    path.write_text(STRATEGY)
    return path


def test_a_strategy_named_by_path_validates_against_its_own_settings(strategy_file: Path) -> None:
    cfg = load_config(TINY, [f"strategy={{kind: '{strategy_file}:SPEC', width: 2}}"])
    assert cfg.strategy.kind == f"{strategy_file}:SPEC" and cfg.strategy.width == 2  # type: ignore[attr-defined]
    assert cfg.strategy_spec.kind == "mine"
    assert cfg.to_dict()["strategy"] == {"kind": f"{strategy_file}:SPEC", "width": 2}  # round-trips
    assert cfg.launch_plan().runner is Runner.COORDINATED
    assert _error([f"strategy={{kind: '{strategy_file}:SPEC', width: 0}}"]) == (
        "strategy.width: must be >= 1 (got 0)"
    )
    assert _error([f"strategy={{kind: '{strategy_file}:SPEC', widht: 1}}"]).startswith(
        "strategy.widht: unknown key; allowed: "
    )
    assert _error([f"strategy={{kind: '{strategy_file}:SPEC', width: 3}}"]) == (
        "strategy.width: must be <= the number of workers (2), got 3"
    )


def test_bad_strategy_names_get_one_line(strategy_file: Path) -> None:
    assert _error(["strategy={kind: nope}"]).startswith(
        "strategy.kind: unknown 'nope'; allowed: adaptive, adpsgd, allreduce"
    )
    assert _error([f"strategy={{kind: '{strategy_file}:NOT_A_SPEC'}}"]).startswith(
        f"strategy.kind: '{strategy_file}:NOT_A_SPEC' is a int, not a StrategySpec"
    )
    assert _error([f"strategy={{kind: '{strategy_file}:MISSING'}}"]).endswith("has no attribute 'MISSING'")
    assert "does not exist" in _error(["strategy={kind: './absent.py:SPEC'}"])
    assert "cannot import module 'no_such_module'" in _error(["strategy={kind: 'no_such_module:SPEC'}"])


def test_specs_are_checked_when_declared_and_registered() -> None:
    with pytest.raises(TypeError, match="identifier"):
        StrategySpec(kind="not a name")
    with pytest.raises(TypeError, match="StrategySettings subclass"):
        StrategySpec(kind="x", settings=dict)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="already registered"):
        registry.register(StrategySpec(kind="allreduce"))
    spec = StrategySpec(kind="toy_registered", settings=StrategySettings)
    registry.register(spec)
    try:
        assert "toy_registered" in registry.kinds() and registry.spec_of("toy_registered") is spec
        with pytest.raises(ConfigError, match="no data-parallel worker"):
            registry.build("toy_registered", None, None, None, None)  # type: ignore[arg-type]
    finally:
        registry.unregister("toy_registered")
    assert "toy_registered" not in registry.kinds()


def test_built_in_checks_run_at_validation() -> None:
    assert _error(["strategy={kind: partial_reduce, group_size: 2}"]).startswith(
        "strategy.group_size: must be >= 2 and < the number of workers (2)"
    )
    default = _error(["strategy={kind: partial_reduce}", "cluster.num_workers=3"])  # (the default P=3)
    assert default == (
        "strategy.group_size: must be >= 2 and < the number of workers (3), got 3 (the default): "
        "set it, e.g. group_size: 2"
    )
    assert _error(["strategy={kind: ps}", "job.optimizer={kind: adam}"]).startswith(
        "strategy.update: 'server_sgd' needs job.optimizer.kind 'sgd'"
    )
    with pytest.raises(ConfigError, match="^strategy.width: must be"):
        raise settings_error("width", "must be")
    assert RunFacts(num_workers=2, batch_size=8).optimizer_kind == ""


def test_unknown_fields_are_named_against_the_kind_the_section_chose() -> None:
    line = _error(["strategy={kind: ps, bucket_bytes: 1}"])
    assert line.startswith("strategy.bucket_bytes: unknown key; allowed: cached_reads, chunk_bytes")
    assert "group_size" not in line and "schedule" not in line  # (other kinds' fields)
    line = _error(["strategy.bucket_byts=1"])
    assert line.endswith("allowed: bucket_bytes, grad_dtype, kind, on_abort, step_timeout_s")
