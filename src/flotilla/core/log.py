"""Logging set-up shared by every role: one line per record, role and worker id in the name."""

from __future__ import annotations

import logging
import os
import sys


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"flotilla.{name}")


def setup_logging(role: str, level: str | None = None) -> None:
    lvl = (level or os.environ.get("FLOTILLA_LOG", "WARNING")).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("flotilla")
    root.handlers[:] = [handler]
    root.setLevel(lvl)
    root.propagate = False
