"""tests/gpu: every test here needs CUDA and is skipped, with the reason, where there is none.

They also carry the ``gpu`` marker, which the default ``addopts`` deselect; run them with
``pytest tests/gpu -m gpu`` on a machine with a GPU (docs/benchmarks.md records the figures).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def cuda_missing_reason() -> str | None:
    """Why the GPU tests cannot run here, or None when CUDA is usable."""
    if torch.cuda.is_available():
        return None
    build = torch.version.cuda or "none (a CPU-only torch build)"
    return f"needs CUDA: torch.cuda.is_available() is False (torch {torch.__version__}, CUDA build: {build})"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = cuda_missing_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(skip)
