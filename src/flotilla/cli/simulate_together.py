"""The emulated devices of a training config as they run here **together** (``flotilla simulate``
of a config whose devices all run on this machine: ``cli/simulate_inputs.py``).

Every device of the job runs in a process of its own, at the same time, the job's step (forward,
backward, the optimizer; the intra-op threads a worker of this job gets here) through the runtime's
own unit (``trainer/step.run_unit``) and the runtime's own emulation (``cluster/emulation.
SpeedEmulator`` at the device's speed: the forward and the backward stretched, the optimizer not,
core waits not counted) -- no collective: a strategy that commits every step alone.  What each
step lasts there is the device's step as the job will see it: slower than in a tight loop alone
(a step after the emulator's sleep finds its caches cold, the neighbours share the cores, the
memory and the caches: measured on the 2-core VM, four devices at 0.25 took 2.2-2.5 ms of compute
per step against 1.36 ms alone in a tight loop and 1.9 ms alone after sleeps).

Returned per nominal speed: the **effective speed** (the tight-loop step over the median step
there: ``step_s / effective`` is what the simulator charges a device of that class) and, over all
devices, the **jitter**: the spread of a step around its device's median (``sigma`` of the log, from
the median absolute deviation), which a barrier pays as the slowest of its members each step.

Processes start with ``spawn`` (each imports torch and builds the task: a few seconds); they begin
together (a barrier) and time steps for ``seconds``; a process that fails is a ``ConfigError``.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import queue
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from flotilla.core.errors import ConfigError

__all__ = ["MAX_PROCESSES", "START_TIMEOUT_S", "Together", "run_processes", "run_together", "summarise"]

MAX_PROCESSES = 16  # devices measured together at most (beyond: measured alone)
SECONDS = 4.0  # every process times steps this long, all at once
START_TIMEOUT_S = 180.0  # for every process to import torch and build the task


@dataclass(frozen=True, slots=True)
class Together:
    """What :func:`run_together` measured: ``effective`` speed per nominal speed, ``sigma`` (the
    jitter), ``steps`` timed per device and the median step (s) per nominal speed."""

    effective: dict[float, float]
    sigma: float
    steps: list[int]
    median_s: dict[float, float]


def run_together(cfg: Any, speeds: Sequence[float], step_s: float, *, seconds: float = SECONDS) -> Together:
    """Run the job's step on ``len(speeds)`` processes at once, each emulating a device of its speed
    (module doc); ``step_s``: the tight-loop step the simulator's speeds are relative to."""
    if not 1 <= len(speeds) <= MAX_PROCESSES:
        raise ValueError(f"run_together: 1 to {MAX_PROCESSES} devices, got {len(speeds)}")
    times = run_processes(_time_steps, [(cfg, float(s)) for s in speeds], seconds=seconds)
    return summarise(speeds, times, step_s)


def run_processes(
    timer: Callable[..., list[float]], jobs: Sequence[tuple[Any, ...]], *, seconds: float = SECONDS,
    what: str = "emulated device",
) -> list[list[float]]:  # fmt: skip
    """Run ``timer(*job, processes, seconds, barrier)`` for every job in a process of its own, all
    at once (``timer``: a module-level function, as ``spawn`` needs; it waits on ``barrier`` when
    it is ready to time, then returns what it timed); the lists in ``jobs``' order.  A process that
    fails or exits, or a start that takes longer than ``START_TIMEOUT_S``: a ``ConfigError`` naming
    the ``what`` and its index."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(jobs))
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_device, args=(timer, job, i, len(jobs), seconds, barrier, results), daemon=True)
        for i, job in enumerate(jobs)
    ]
    for p in procs:
        p.start()
    got: dict[int, list[float]] = {}
    errors: dict[int, str] = {}
    try:
        deadline = time.monotonic() + START_TIMEOUT_S + 4 * seconds
        while len(got) < len(procs):
            try:
                index, times, error = results.get(timeout=0.5)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if i not in got and p.exitcode is not None]
                if dead and results.empty():
                    raise ConfigError(
                        f"simulate: {what} {dead[0]}'s process exited ({procs[dead[0]].exitcode}) "
                        "before it measured anything"
                    ) from None
                if time.monotonic() > deadline:
                    raise ConfigError(
                        f"simulate: measuring the {len(jobs)} {what}s together timed out"
                    ) from None
                continue
            got[index] = times
            if error:
                errors[index] = error
                if not error.startswith("BrokenBarrierError"):  # (the others' barrier: its echo)
                    raise ConfigError(f"simulate: measuring {what} {index} failed: {error}")
        if errors:
            index, error = min(errors.items())
            raise ConfigError(f"simulate: measuring {what} {index} failed: {error}")
    finally:
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
    return [got[i] for i in range(len(jobs))]


def summarise(speeds: Sequence[float], times: Sequence[Sequence[float]], step_s: float) -> Together:
    """Pure: per nominal speed the median of its devices' steps and ``step_s`` over it; the jitter
    from every step's log distance to its device's median (1.4826 x their median absolute value)."""
    by_speed: dict[float, list[float]] = {}
    logs: list[float] = []
    for s, ts in zip(speeds, times, strict=True):
        if not ts:
            raise ConfigError(f"simulate: the emulated device of speed {s:g} timed no step")
        m = statistics.median(ts)
        by_speed.setdefault(float(s), []).extend(ts)
        logs.extend(abs(math.log(t / m)) for t in ts if t > 0 and m > 0)
    median_s = {s: statistics.median(ts) for s, ts in by_speed.items()}
    effective = {s: min(s, step_s / m) if m > 0 else s for s, m in median_s.items()}
    sigma = 1.4826 * statistics.median(logs) if logs else 0.0
    return Together(effective, sigma, [len(ts) for ts in times], median_s)


def _device(
    timer: Callable[..., list[float]], job: tuple[Any, ...], index: int, processes: int, seconds: float,
    barrier: Any, results: Any,
) -> None:  # fmt: skip
    """One process of :func:`run_processes`: what its timer timed, or the error."""
    try:
        times = timer(*job, processes, seconds, barrier)
        results.put((index, times, ""))
    except Exception as exc:  # (reported to the parent, which names the device)
        try:
            barrier.abort()
        except Exception:
            pass
        results.put((index, [], f"{type(exc).__name__}: {exc}"))


def _time_steps(cfg: Any, speed: float, processes: int, seconds: float, barrier: Any) -> list[float]:
    import torch

    from flotilla.cli.simulate_measure import step_parts
    from flotilla.cluster.emulation import SpeedEmulator
    from flotilla.core.threads import LOCAL_PROCS_VAR, thread_count, usable_cores
    from flotilla.sync.base import Outcome, Proposal, SyncStrategy
    from flotilla.trainer.step import Minibatch, run_unit, stretch_optimizer_steps

    torch.set_num_threads(thread_count({LOCAL_PROCS_VAR: str(processes)}, usable_cores()))
    _, model, opt, (x, y), _ = step_parts(cfg, processes)

    class Alone(SyncStrategy):  # (commits every step by itself: no collective)
        kind = "alone"

        def begin_step(self, step: int) -> None:
            opt.zero_grad(set_to_none=True)

        def synchronize(self, proposal: Proposal) -> Outcome:
            opt.step()
            return Outcome(committed=True)

    sync, emulator = Alone(), SpeedEmulator(speed)
    stretch_optimizer_steps(opt, emulator, torch.device("cpu"))  # (as the worker does)
    batch = (Minibatch(0, x, y),)
    for _ in range(2):  # (warm-up, before the others start too)
        run_unit(model, sync, batch, global_batch=cfg.job.batch_size, emulator=emulator)
    barrier.wait(timeout=START_TIMEOUT_S)
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        run_unit(model, sync, batch, global_batch=cfg.job.batch_size, emulator=emulator)
        times.append(time.perf_counter() - t0)
    return times[2:] if len(times) > 7 else times
