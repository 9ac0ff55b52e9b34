"""Where a role started by a scheduler finds its coordinator and its name (pure: a mapping in).

Precedence, first match wins (``docs/multihost.md`` has the table):

coordinator address
  1. the command line (``--coordinator HOST:PORT`` or ``--coordinator-file``);
  2. ``FLOTILLA_COORDINATOR`` (``HOST:PORT``; a Kubernetes manifest sets it to the
     coordinator's Service name);
  3. torchrun / torch-style launchers: ``MASTER_ADDR`` (host) with ``FLOTILLA_COORDINATOR_PORT``;
  4. SLURM: the first host of ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``) with
     ``FLOTILLA_COORDINATOR_PORT`` -- the batch script starts the coordinator there.
  ``FLOTILLA_COORDINATOR_PORT`` defaults to ``DEFAULT_PORT``.  (``MASTER_PORT`` is never used:
  under torchrun it is torchrun's own store.)

worker name
  1. ``--name``;  2. ``FLOTILLA_NAME``;  3. torchrun: ``w<RANK>``;
  4. Kubernetes Indexed Job: ``w<JOB_COMPLETION_INDEX>``;  5. SLURM: ``w<SLURM_PROCID>``.
  (``w<i>`` is the name of the i-th worker of a ``num_workers`` cluster.)

Nothing here reads the process environment itself: callers pass ``os.environ``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from flotilla.core.errors import ConfigError

__all__ = ["DEFAULT_PORT", "coordinator_from_env", "first_host", "name_from_env"]

DEFAULT_PORT = 5555


def _port(env: Mapping[str, str]) -> int:
    raw = env.get("FLOTILLA_COORDINATOR_PORT", str(DEFAULT_PORT))
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise ConfigError(f"FLOTILLA_COORDINATOR_PORT: expected a port in 1..65535, got {raw!r}")
    return int(raw)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``node[03-05,9],gpu1`` -> ``node03``."""
    item = re.match(r"[^,\[]*(\[[^\]]*\])?[^,]*", nodelist.strip())
    text = item.group(0) if item else ""
    if not text:
        raise ConfigError(f"SLURM_JOB_NODELIST: no host in {nodelist!r}")
    bracket = re.search(r"\[([^\]]*)\]", text)
    if bracket is None:
        return text
    first = bracket.group(1).split(",")[0].split("-")[0]
    if not first:
        raise ConfigError(f"SLURM_JOB_NODELIST: cannot read the host range of {nodelist!r}")
    return text[: bracket.start()] + first + text[bracket.end() :]


def coordinator_from_env(env: Mapping[str, str]) -> tuple[str, str] | None:
    """``(HOST:PORT, the variable it came from)``, or None when no scheduler says."""
    if env.get("FLOTILLA_COORDINATOR"):
        return env["FLOTILLA_COORDINATOR"], "FLOTILLA_COORDINATOR"
    if env.get("MASTER_ADDR"):
        return _join(env["MASTER_ADDR"], _port(env)), "MASTER_ADDR (torchrun)"
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodelist:
        return _join(first_host(nodelist), _port(env)), "SLURM_JOB_NODELIST (first host)"
    return None


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_NAME_SOURCES = (
    ("RANK", "torchrun"),
    ("JOB_COMPLETION_INDEX", "Kubernetes Indexed Job"),
    ("SLURM_PROCID", "SLURM"),
)


def name_from_env(env: Mapping[str, str]) -> tuple[str, str] | None:
    """``(worker name, the variable it came from)``, or None."""
    if env.get("FLOTILLA_NAME"):
        return env["FLOTILLA_NAME"], "FLOTILLA_NAME"
    for var, scheduler in _NAME_SOURCES:
        value = env.get(var, "")
        if value:
            if not value.isdigit():
                raise ConfigError(f"{var}: expected a non-negative integer, got {value!r}")
            return f"w{int(value)}", f"{var} ({scheduler})"
    return None
