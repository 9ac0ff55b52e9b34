"""Live progress display for ``flotilla run`` (rich), and a plain fallback for non-terminals.

Shows: global step, samples/s, loss, number of workers and membership epoch, and one row per
worker with its speed factor, state, step and throughput.  Ends with a summary table.
"""

from __future__ import annotations

import math
import sys
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def status_table(snap: dict, total_steps: int) -> Table:
    workers = snap["workers"]
    training = [w for w in workers if w["state"] == "training"]
    step = max((w["step"] for w in workers), default=0)
    sps = sum(w["samples_per_s"] for w in training)
    losses = [w["loss"] for w in training if not math.isnan(w["loss"])]
    loss = sum(losses) / len(losses) if losses else None
    acc = snap["evals"][-1]["test_accuracy"] if snap["evals"] else None
    title = (f"step {step}/{total_steps}  {sps:,.0f} samples/s  loss {_fmt(loss)}  "
             f"test acc {_fmt(acc)}  workers {len(snap['members'])}  view {snap['epoch']}  "
             f"{snap['elapsed_s']:.0f}s")
    if snap.get("strategy") == "ps" and training:   # per-worker clocks are the steps shown below
        spread = max(w["step"] for w in training) - min(w["step"] for w in training)
        title += f"  clock spread {spread}"
    table = Table(title=title, title_justify="left")
    for col in ("worker", "id", "speed", "state", "step", "samples/s", "loss", "view"):
        table.add_column(col, justify="right" if col not in ("worker", "state") else "left")
    for w in workers:
        table.add_row(w["name"], str(w["worker_id"]), f"{w['speed']:.2f}", w["state"], str(w["step"]),
                      f"{w['samples_per_s']:,.0f}", _fmt(w["loss"]), str(w["membership_epoch"]))
    return table


class Progress:
    """Context manager; ``update(snapshot)`` refreshes at most ~4 times a second."""

    def __init__(self, *, enabled: bool, total_steps: int) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.console = Console(stderr=True)
        self._live: Live | None = None
        self._last_print = 0.0

    def __enter__(self) -> "Progress":
        if self.enabled and self.console.is_terminal:
            self._live = Live(console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def update(self, snap: dict) -> None:
        if not self.enabled:
            return
        if self._live is not None:
            self._live.update(status_table(snap, self.total_steps))
            return
        now = time.monotonic()
        if now - self._last_print >= 5.0:      # plain log line when not on a terminal
            self._last_print = now
            t = status_table(snap, self.total_steps)
            print(t.title, file=sys.stderr, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)


def summary_table(summary: dict) -> Table:
    table = Table(title="flotilla run summary", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("completed", "test_accuracy", "test_loss", "steps", "wall_s", "samples_per_s",
                "num_workers", "num_workers_started", "membership_epochs", "strategy"):
        val = summary.get(key)
        table.add_row(key, _fmt(val, ".4f") if isinstance(val, float) else str(val))
    for w in summary.get("workers", []):
        table.add_row(f"worker {w['name']}", f"speed {w['speed']:.2f}, {w['state']}, step {w['step']}")
    return table
