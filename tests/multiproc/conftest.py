"""Fixtures shared by the multi-process tests."""

from __future__ import annotations

import functools

import pytest

from tests.multiproc import _netns


@functools.cache
def _why_no_netns() -> str | None:
    return _netns.unavailable()


@pytest.fixture
def hosts():
    """Two hosts made of network namespaces (``_netns.Hosts``), deleted in the teardown (on failure
    too); the test is skipped with the reason where namespaces cannot be made (not root, no ``ip``)."""
    why = _why_no_netns()
    if why is not None:
        pytest.skip(why)
    with _netns.Hosts(2) as made:
        yield made
