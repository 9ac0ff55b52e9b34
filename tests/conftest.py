"""Suite-wide collection order: the longest test files first.

``make test`` runs the suite in two processes (pytest-xdist, ``--dist loadfile
--no-loadscope-reorder``: whole files, in collection order -- without the flag xdist puts the
files with the most tests first, so the long single-test files ran last -- to whichever process
is free).  A long file collected last would run alone at
the end while the other process idles; started first, the short files fill in around it.  The
list is the files that took 45 s or more in a measured run (``--durations``); a file missing from
it only costs some idle time at the end, never a wrong result (tests do not depend on order).
"""

from __future__ import annotations

import pytest

LONGEST_FIRST = (
    "tests/multiproc/test_resume.py",
    "tests/multiproc/test_adaptive_run.py",
    "tests/multiproc/test_ps_bsp_determinism.py",
    "tests/multiproc/test_ps_churn.py",
    "tests/multiproc/test_ps_same_lr.py",
    "tests/multiproc/test_chaos.py",
    "tests/multiproc/test_ps_shard_restart.py",
    "tests/multiproc/test_elastic_run.py",
    "tests/multiproc/test_revocations_run.py",
    "tests/multiproc/test_diloco_run.py",
    "tests/multiproc/test_resume_dropout.py",
    "tests/multiproc/test_adpsgd_run.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}

    def key(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(LONGEST_FIRST))

    items.sort(key=key)  # (stable: within a file and among the rest, collection order is kept)
