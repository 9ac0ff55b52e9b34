"""Live progress display for ``flotilla run`` (rich), and a plain fallback for non-terminals.

Shows: global step with a progress bar, samples/s, loss, the latest evaluation's headline metric
(the task's, e.g. ``test rmse``; ``report/headline.py``), number of workers and membership epoch,
elapsed time and the time remaining (ETA), and one row per worker with its speed factor, state,
step and throughput.  The bar and the ETA follow the *slowest* training worker
(:func:`progress_step`): an asynchronous job (ps, partial reduce, AD-PSGD) ends with it; the ETA
is the remaining steps over the recent rate of that step (:class:`StepRate`, the last 10 s).
Ends with a summary table that lists the headline first and only the evaluation results the task
has.
"""

from __future__ import annotations

import collections
import math
import sys
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

from flotilla.report.headline import HEADLINE_MODE, headline_value


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def progress_step(snap: dict) -> int:
    """The step the whole job has reached: the slowest training worker's (the furthest worker's
    when none is training)."""
    steps = [w["step"] for w in snap["workers"] if w["state"] == "training"]
    return min(steps) if steps else max((w["step"] for w in snap["workers"]), default=0)


def progress_bar(done: int, total: int, width: int = 20) -> str:
    """``██████░░░░ 60%``: ``done`` of ``total`` in ``width`` cells."""
    frac = min(1.0, max(0.0, done / total)) if total > 0 else 0.0
    full = int(frac * width)
    return "█" * full + "░" * (width - full) + f" {100 * frac:.0f}%"


def clock_text(seconds: float | None) -> str:
    """``1:02:03`` or ``2:03``; ``-`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def status_table(
    snap: dict, total_steps: int, rate: float | None = None, eta_s: float | None = None
) -> Table:
    """``rate``: the job's samples/s measured over recent snapshots (:class:`Progress`); without
    it, the sum of the training workers' last-step rates.  ``eta_s``: the time remaining
    (:class:`StepRate`)."""
    workers = snap["workers"]
    training = [w for w in workers if w["state"] == "training"]
    step = max((w["step"] for w in workers), default=0)
    sps = rate if rate is not None else sum(w["samples_per_s"] for w in training)
    losses = [w["loss"] for w in training if not math.isnan(w["loss"])]
    loss = sum(losses) / len(losses) if losses else None
    title = (
        f"step {step}/{total_steps} {progress_bar(progress_step(snap), total_steps)}  "
        f"{sps:,.0f} samples/s  loss {_fmt(loss)}  "
        f"{_headline_text(snap['evals'])}workers {len(snap['members'])}  view {snap['epoch']}  "
        f"elapsed {clock_text(snap['elapsed_s'])}  ETA {clock_text(eta_s)}"
    )
    ps = snap.get("strategy") == "ps"
    if ps and snap.get("clock_spread") is not None:
        # every worker's clock at the same instant (coordinator, clock_spread.py), not the
        # difference of their latest reports, which arrive up to a heartbeat apart
        title += f"  clock spread {snap['clock_spread']} (max {snap['max_clock_spread']})"
    own = snap.get(str(snap.get("strategy")))  # the strategy's service's counts
    if isinstance(own, dict) and own.get("running"):  # (a kind that switches between others)
        switches = own.get("switches") or []
        title += f"  running {own['running']}"
        if switches:
            last = switches[-1]
            title += (
                f" ({len(switches)} switches, last {last['from']} -> {last['to']} at step {last['step']})"
            )
    pr = snap.get("partial_reduce")
    if pr:  # strategy partial_reduce: the controller's groups and version lag
        lag = ",".join(f"{w}:{v}" for w, v in pr["version_lag"].items())
        title += (
            f"  groups {pr['groups']} ({pr['groups_per_s']:.1f}/s, mean size {pr['mean_group_size']:.2f})"
        )
        title += f"  version lag {lag}"
    table = Table(title=title, title_justify="left")
    cols = (
        "worker",
        "id",
        "speed",
        "state",
        "step",
        *(("clock",) if ps else ()),
        "samples/s",
        "loss",
        "view",
    )
    for col in cols:
        table.add_column(col, justify="right" if col not in ("worker", "state") else "left")
    for w in workers:
        clock = (_fmt(w.get("clock"), "d"),) if ps else ()
        table.add_row(
            w["name"],
            str(w["worker_id"]),
            f"{w['speed']:.2f}",
            w["state"],
            str(w["step"]),
            *clock,
            f"{w['samples_per_s']:,.0f}",
            _fmt(w["loss"]),
            str(w["membership_epoch"]),
        )
    return table


def _headline_text(evals: list[dict]) -> str:
    """``test rmse 0.123  `` from the latest evaluation; empty before the first one."""
    found = headline_value(evals[-1]) if evals else None
    if found is None:
        return ""
    head, value = found
    return f"test {head.metric} {_fmt(value, '.4f')}  "


class SampleRate:
    """The job's samples/s from the workers' cumulative ``samples`` in successive snapshots,
    over the last ``window_s`` (at least ``min_s``): records arrive in heartbeat batches, so the
    sum of the workers' last-step rates swings (under SSP it showed up to 8,400 samples/s for a
    job training 5,600)."""

    def __init__(self, window_s: float = 3.0, min_s: float = 1.0) -> None:
        self.window_s, self.min_s = window_s, min_s
        self._points: collections.deque[tuple[float, int]] = collections.deque()

    def update(self, snap: dict) -> float | None:
        workers = snap["workers"]
        if not workers or any("samples" not in w for w in workers):
            return None
        now, total = float(snap["elapsed_s"]), sum(int(w["samples"]) for w in workers)
        self._points.append((now, total))
        while len(self._points) > 2 and now - self._points[1][0] >= self.window_s:
            self._points.popleft()
        t0, s0 = self._points[0]
        return (total - s0) / (now - t0) if now - t0 >= self.min_s else None


class StepRate:
    """The time remaining: the remaining steps over the rate of :func:`progress_step` in the last
    ``window_s`` of snapshots (at least ``min_s`` of history and one step made)."""

    def __init__(self, window_s: float = 10.0, min_s: float = 2.0) -> None:
        self.window_s, self.min_s = window_s, min_s
        self._points: collections.deque[tuple[float, int]] = collections.deque()

    def eta_s(self, snap: dict, total_steps: int) -> float | None:
        now, step = float(snap["elapsed_s"]), progress_step(snap)
        self._points.append((now, step))
        while len(self._points) > 2 and now - self._points[1][0] >= self.window_s:
            self._points.popleft()
        t0, s0 = self._points[0]
        if now - t0 < self.min_s or step <= s0:
            return None
        return max(0, total_steps - step) * (now - t0) / (step - s0)


class Progress:
    """Context manager; ``update(snapshot)`` refreshes at most ~4 times a second."""

    def __init__(self, *, enabled: bool, total_steps: int) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.console = Console(stderr=True)
        self._live: Live | None = None
        self._last_print = 0.0
        self._rate = SampleRate()
        self._steps = StepRate()

    def __enter__(self) -> Progress:
        if self.enabled and self.console.is_terminal:
            self._live = Live(console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def update(self, snap: dict) -> None:
        if not self.enabled:
            return
        rate, eta = self._rate.update(snap), self._steps.eta_s(snap, self.total_steps)
        if self._live is not None:
            self._live.update(status_table(snap, self.total_steps, rate, eta))
            return
        now = time.monotonic()
        if now - self._last_print >= 5.0:  # plain log line when not on a terminal
            self._last_print = now
            t = status_table(snap, self.total_steps, rate, eta)
            print(t.title, file=sys.stderr, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)


def summary_table(summary: dict) -> Table:
    table = Table(title="flotilla run summary", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    found = headline_value(summary)
    head = [found[0].field] if found is not None else []
    keys = [
        "completed",
        *head,
        "steps",
        "wall_s",
        "samples_per_s",
        "num_workers",
        "num_workers_started",
        "membership_epochs",
        "strategy",
    ]
    if summary.get("max_clock_spread") is not None:
        keys.append("max_clock_spread")
    keys += [
        k
        for k in ("pr_groups", "pr_aborted", "pr_groups_per_s", "pr_mean_group_size", "pr_version_lag")
        if k in summary
    ]
    at = len(head) + 1  # the task's other results after the headline, "test_loss" among them
    keys[at:at] = sorted(k for k in summary if k.startswith("test_") and k not in keys)
    if summary.get("model_file"):
        keys.append("model_file")
    for key in keys:
        val = summary.get(key)
        label = f"{key} ({summary[HEADLINE_MODE]})" if head == [key] and summary.get(HEADLINE_MODE) else key
        table.add_row(label, _fmt(val, ".4f") if isinstance(val, float) else str(val))
    for w in summary.get("workers", []):
        clock = f", clock {w['clock']}" if w.get("clock") is not None else ""
        if w.get("joined_at_clock"):
            clock = f", joined at clock {w['joined_at_clock']}{clock}"
        rate = f", {w['samples_per_s']:,.0f} samples/s" if w.get("samples_per_s") else ""
        table.add_row(
            f"worker {w['name']}", f"speed {w['speed']:.2f}, {w['state']}, step {w['step']}{clock}{rate}"
        )
    return table
