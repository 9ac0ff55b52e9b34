"""``strategy: {kind: hetpipe}``'s settings (``sync/hetpipe.py``): a registered kind run by the
pipeline runner with PipeDream's schedule at ``s_local + 1`` minibatches in flight; bad values are
one line naming the field, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.config import load_config
from flotilla.core.errors import ConfigError
from flotilla.pipeline.schedule import pipedream
from flotilla.sync.stage_plug import stage_plug
from flotilla.trainer.pipeline_setup import job_schedule, pipeline_strategy

CONFIG = """
cluster:
  workers: [{name: a0}, {name: a1}, {name: b0}, {name: b1}]
job:
  model: {name: char_transformer, width: 16}
  dataset: {name: pysource, num_samples: 200, test_fraction: 0.2}
  batch_size: 8
  steps: 6
strategy: {kind: hetpipe, placement: given, num_stages: 2, replicas: 2, s_local: 2, clock_distance: 1}
"""


def _cfg(tmp_path: Path, *overrides: str):
    path = tmp_path / "hp.yaml"
    path.write_text(CONFIG)
    return load_config(path, list(overrides))


def test_hetpipe_runs_pipedream_with_s_local_plus_one_in_flight(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    st = pipeline_strategy(cfg)
    assert st.kind == "hetpipe" and st.schedule == "pipedream" and st.in_flight() == 3
    assert job_schedule(cfg, 6) == pipedream(2, 6, in_flight=3)
    plug = stage_plug(cfg)
    assert plug is not None and plug.independent_instances


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("strategy.replicas=3", "strategy.replicas"),  # 2 stages x 3 VWs != 4 workers
        ("strategy.s_local=-1", "strategy.s_local"),
        ("strategy.clock_distance=-2", "strategy.clock_distance"),
        ("strategy.schedule=gpipe", "strategy.schedule"),
        ("strategy.num_microbatches=4", "strategy.num_microbatches"),
        ("strategy.placement=best", "strategy.placement"),
        ("strategy.placement=auto", "strategy.num_stages"),  # (a placement decides the stages)
        ("strategy={kind: hetpipe, placement: ed, replicas: 2}", "strategy.replicas"),
        ("strategy={kind: hetpipe, placement: given, num_stages: 2}", "strategy.replicas"),
    ],
)
def test_bad_hetpipe_settings_are_refused_naming_the_field(tmp_path: Path, override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        _cfg(tmp_path, override)


def test_a_plain_pipeline_has_no_stage_plug(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "strategy={kind: pipeline, num_stages: 2, replicas: 2, num_microbatches: 2}")
    assert stage_plug(cfg) is None and pipeline_strategy(cfg).in_flight() is None


def test_the_example_leaves_the_virtual_workers_to_the_placement() -> None:
    cfg = load_config(Path(__file__).parents[2] / "examples" / "hetpipe.yaml", [])
    st = pipeline_strategy(cfg)
    assert (st.kind, st.placement, st.num_stages, st.replicas) == ("hetpipe", "auto", None, None)
    assert st.num_processes == 0 and len(cfg.launch_plan().workers) == 8  # (any worker may be placed)


TIED = """
cluster:
  workers:
    - {name: a0, type: A, node: n0}
    - {name: a1, type: A, node: n0}
job:
  task: "TASK"
  task_args: {vocab: 16, seq_len: 12, dim: 32, num_samples: 400, seed: 0}
  batch_size: 16
  steps: 4
strategy: {kind: hetpipe, placement: np}
"""


def test_a_tie_the_placement_splits_is_refused_by_validate_and_plan_as_by_run(tmp_path: Path) -> None:
    """A VW runs PipeDream, which cannot keep a parameter tied across two stages: ``flotilla run``
    refused it after ``validate`` and ``plan`` had passed it (the placed VWs were not checked)."""
    from typer.testing import CliRunner

    from flotilla.cli.main import app
    from flotilla.launch.validation import validate

    task = Path(__file__).resolve().parents[2] / "examples" / "own_task" / "task.py"
    path = tmp_path / "tied.yaml"
    path.write_text(TIED.replace("TASK", f"{task}:TiedLM"))
    cfg = load_config(path, [])
    why = r"0\.weight is tied across stages 0, 1 .* strategy hetpipe runs every pipeline with it"
    with pytest.raises(ConfigError, match=why):
        validate(cfg)
    for command in ("validate", "plan"):
        out = CliRunner().invoke(app, [command, str(path)])
        assert out.exit_code != 0 and "strategy hetpipe runs every pipeline with it" in out.output, out.output
