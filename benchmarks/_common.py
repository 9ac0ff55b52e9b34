"""Small helpers shared by the benchmarks: statistics, alternating order, machine info and CPU use,
JSON output, and child processes that are always torn down.

Invariants
- Statistics are computed on the raw samples (no outlier removal); percentiles interpolate linearly.
- ``alternating_orders`` swaps the order of the contenders every round, so a slow drift of the
  machine (thermal, other tenants) is spread evenly over them.
- ``Children`` kills every process it started when its ``with`` block exits, whatever the reason
  (normal end, exception, Ctrl-C); a worker started with ``exit_with_parent`` also ends by itself
  if its parent disappears.
- No pickle: workers are plain subprocesses that get their arguments on the command line and hand
  results back as JSON files.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` with linear interpolation."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, p10, p90, min, max and count of ``values``."""
    return {
        "median": median(values),
        "p10": percentile(values, 10.0),
        "p90": percentile(values, 90.0),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def alternating_orders(names: Sequence[str], rounds: int) -> list[list[str]]:
    """Round ``r`` runs ``names`` forwards when ``r`` is even and backwards when it is odd."""
    return [list(names) if r % 2 == 0 else list(reversed(names)) for r in range(rounds)]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """What the figures were measured on."""
    import torch

    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "nproc": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        info["loadavg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    return info


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot (``/proc/stat``); (0, 0) if unreadable."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_busy(since: tuple[int, int]) -> float:
    """Share of all cores' time spent busy since ``since`` (``cpu_jiffies()``), 0..1."""
    busy, total = cpu_jiffies()
    return (busy - since[0]) / (total - since[1]) if total > since[1] else float("nan")


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically (temp file + rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, target)


def report_medians(
    a: Any,
    t_start: float,
    metric: str,
    medians: dict[str, float],
    runs: dict[str, list[float]],
    ratio: float,
    *,
    digits: int,
    extra: dict[str, Any] | None = None,
    ratio_note: str = "",
    ratio_name: str = "ratio",
) -> None:
    """The end of an alternating benchmark: the machine and wall time, one row per contender
    (median ``metric`` and the per-round values), ``--json`` output when ``a.json`` is set
    (``a``'s fields, the machine, ``extra``, the medians, the ratio) and the last line
    ``<ratio_name>=...`` (``ratio=`` unless told)."""
    info = machine_info()
    print(f"machine: {info}; wall {time.monotonic() - t_start:.1f} s")
    width = max(5, *(len(n) for n in medians))
    print(f"{'name':{width}s}  median_{metric}  runs")
    for name, value in medians.items():
        print(
            f"{name:{width}s}  {value:{len(metric) + 7}.{digits}f}  {[round(x, digits) for x in runs[name]]}"
        )
    if a.json:
        write_json(
            a.json,
            {
                "args": {k: str(v) for k, v in vars(a).items()},
                "machine": info,
                **(extra or {}),
                f"median_{metric}": medians,
                "ratio": ratio,
                "ratio_name": ratio_name,  # (what "ratio" is: the last line's name)
            },
        )
    print(f"{ratio_name}={ratio:.3f}" + (f"  ({ratio_note})" if ratio_note else ""))


def exit_with_parent(poll_s: float = 0.5) -> None:
    """In a worker: end this process as soon as the process that started it is gone."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


class Children:
    """Start subprocesses; on exit of the ``with`` block every one still running is ended."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(list(argv), env=env)
        self.procs.append(proc)
        return proc

    def wait_all(self, timeout_s: float) -> list[int | None]:
        """Exit codes of the children (``None``: still running); TimeoutError after ``timeout_s``.

        Returns as soon as every child ended or one failed: a peer of a failed worker would only
        block in its next collective until its timeout (the ``with`` block then ends it).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                return codes
            if time.monotonic() > deadline:
                raise TimeoutError(f"children still running after {timeout_s:.0f} s")
            time.sleep(0.05)

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def stop_all(self, grace_s: float = 3.0) -> None:
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in alive:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def python() -> str:
    """The interpreter running this benchmark (children use the same one, hence the same venv)."""
    return sys.executable
