"""``launch/supervisor.exit_cause``: why a worker that exited with an error did, in one line, for
the job's last line (``member lost: ... process exited with code 1: ValueError: ...``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from flotilla.launch.supervisor import exit_cause

TRACEBACK = """\
2026-12-01 06:48:53,100 worker w1 INFO flotilla.loop: worker 1 adopted view 1
╭───────────────────── Traceback (most recent call last) ─────────────────────╮
│ /tmp/x/badtask.py:44 in loss                                                 │
╰──────────────────────────────────────────────────────────────────────────────╯
RuntimeError: element 0 of tensors does not require grad and does not have a
grad_fn
"""


def _cause(tmp_path: Path, text: str | None) -> str:
    log = tmp_path / "w.log"
    if text is not None:
        log.write_text(text)
    return exit_cause(SimpleNamespace(log_path=log))  # type: ignore[arg-type]


def test_the_exception_after_the_traceback_box_is_one_line(tmp_path: Path) -> None:
    assert _cause(tmp_path, TRACEBACK) == (
        "RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn"
    )


def test_an_error_line_wins_and_nothing_known_is_empty(tmp_path: Path) -> None:
    assert _cause(tmp_path, TRACEBACK + "error: task 'x': loss failed\n") == "task 'x': loss failed"
    assert _cause(tmp_path, "2026-12-01 worker w1 INFO started\n") == ""
    assert _cause(tmp_path, None) == ""  # (no log at all)
    assert _cause(tmp_path, "ValueError: plain, no box\n") == "ValueError: plain, no box"
    assert len(_cause(tmp_path, "error: " + "x" * 1000 + "\n")) == 300
