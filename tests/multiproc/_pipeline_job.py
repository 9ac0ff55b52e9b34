"""The small two-stage pipeline job the multi-process pipeline tests share: a char transformer on
the shipped Python-source data set, one fast and one half-speed device, 1F1B.  ``pipeline_cfg``
loads it with the test's overrides (``steps`` and ``eval_every_steps`` are the usual ones)."""

from __future__ import annotations

from pathlib import Path

from flotilla.config import load_config

CONFIG = """
cluster:
  workers: [{name: fast, speed: 1.0, memory_bytes: 64MiB}, {name: slow, speed: 0.5, memory_bytes: 64MiB}]
job:
  model: {name: char_transformer, width: 32}
  dataset: {name: pysource, num_samples: 600, test_fraction: 0.2}
  optimizer: {kind: adam, lr: 0.003}
  batch_size: 16
  steps: 8
  eval_every_steps: 4
strategy: {kind: pipeline, schedule: 1f1b, num_stages: 2, num_microbatches: 4, step_timeout_s: 20}
"""


def pipeline_cfg(tmp_path: Path, *overrides: str):  # -> flotilla.config.Config
    """The shared pipeline job with ``overrides`` (``key=value``, as ``--set`` takes them)."""
    path = tmp_path / "pipe.yaml"
    path.write_text(CONFIG)
    return load_config(path, list(overrides))
