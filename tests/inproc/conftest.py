"""Fixtures of the in-process tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ._adpsgd_cluster import Cluster


@pytest.fixture
def cluster_of() -> Iterator[Any]:
    """``cluster_of(n, **kw)``: an in-process AD-PSGD cluster of ``n`` workers, closed afterwards."""
    made: list[Cluster] = []

    def make(n: int, **kw: Any) -> Cluster:
        made.append(Cluster(n, **kw))
        return made[-1]

    yield make
    for c in made:
        c.close()
