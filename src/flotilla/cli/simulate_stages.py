"""A pipeline's emulated stages as they run here **together** (``flotilla simulate`` of a pipeline
config whose stages all run on this machine: ``cli/simulate_inputs.py``).

A stage computes in short actions -- one microbatch's forward or backward -- each stretched by the
emulator and followed by its sleep, so it finds its caches colder than a whole data-parallel step
does, and the runtime's own work per action (the microbatch's rows, the saved-tensor count, the
loss) weighs more beside a small microbatch: measured on the 2-core VM, ``examples/pipeline_lm.
yaml``'s second stage (speed 0.25) computed 2.55 ms per microbatch in the run against 1.84 ms in
its layer profile, which is what the simulator charged (docs/simulator.md).

Every stage of the job runs in a process of its own, at the same time (``cli/simulate_together.
run_processes``), its layers of the runtime's split (``trainer/pipeline_setup.plan_for_run``) in
the runtime's own stage (``pipeline/runtime.StageRuntime`` with the run's options and
``cluster/emulation.SpeedEmulator`` at the stage's speed) over a one-stage GPipe schedule of the
job's microbatches: every forward, every backward, then the update, as a flush runs them.  No
messages (their cost is the links', which the simulator models apart); a stage after the first
takes its input from the layers before it, run once; a stage before the last ends with a sum
against a fixed gradient where the run would receive one.

Returned as :class:`~flotilla.cli.simulate_together.Together`: per nominal speed, the **effective
speed** -- the stage's profiled time per step (its layers' forward and backward per microbatch,
its update) over the time it took there -- which the simulator's device classes take, as the
data-parallel measurement's do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flotilla.cli.simulate_together import SECONDS, Together, run_processes, summarise

__all__ = ["StageWork", "run_stages_together", "stage_work"]


StageWork = tuple[int, int, float]  # (first layer, end layer, speed)


def stage_work(
    profile: Any, ranges: Sequence[tuple[int, int]], updates: Sequence[float]
) -> list[tuple[float, float]]:
    """Pure: per stage (its layers ``[first, end)``) the profiled seconds of one microbatch's
    forward and backward, and of its update (``updates``: per layer; empty: 0)."""
    return [
        (
            sum(layer.forward_s + layer.backward_s for layer in profile.layers[first:end]),
            sum(updates[first:end]) if updates else 0.0,
        )
        for first, end in ranges
    ]


def run_stages_together(
    cfg: Any, stages: Sequence[StageWork], profile: Any, updates: Sequence[float], micro: int,
    *, seconds: float = SECONDS,
) -> Together:  # fmt: skip
    """Run every stage of ``stages`` at once (module doc) on microbatches of ``micro`` samples;
    ``profile``/``updates``: what the simulator charges at speed 1 (the ratio is the measure)."""
    num_micro = int(cfg.strategy.num_microbatches)
    work = stage_work(profile, [(first, end) for first, end, _ in stages], updates)
    jobs = [(cfg, first, end, float(speed), micro) for first, end, speed in stages]
    times = run_processes(_time_stage, jobs, seconds=seconds, what="pipeline stage")
    ratios = []
    for (each, update), ts in zip(work, times, strict=True):
        profiled = num_micro * each + update  # (a flush: every microbatch, one update)
        ratios.append([t / profiled for t in ts] if profiled > 0 else [])
    return summarise([s for _, _, s in stages], ratios, 1.0)


def _time_stage(
    cfg: Any, first: int, end: int, speed: float, micro: int, processes: int, seconds: float, barrier: Any
) -> list[float]:
    """One stage's process: the seconds of each flush (every microbatch's forward and backward
    through the runtime's stage, then its update), after two untimed ones."""
    import time

    import torch

    from flotilla.cluster.emulation import SpeedEmulator
    from flotilla.core.threads import LOCAL_PROCS_VAR, thread_count, usable_cores
    from flotilla.pipeline.runtime import RuntimeOptions, StageRuntime
    from flotilla.pipeline.schedule import ScheduleKind, make_schedule
    from flotilla.trainer.builders import make_optimizer
    from flotilla.trainer.pipeline_setup import pipeline_parts, pipeline_strategy

    torch.set_num_threads(thread_count({LOCAL_PROCS_VAR: str(processes)}, usable_cores()))
    parts = pipeline_parts(cfg)
    settings = pipeline_strategy(cfg)
    layers = list(parts.model)
    module = torch.nn.Sequential(*layers[first:end])
    x, y = parts.train.batch(list(range(min(micro, parts.train.num_samples))))
    if first > 0:
        with torch.no_grad():
            x = torch.nn.Sequential(*layers[:first])(x).detach()
    last = end == len(layers)
    num_micro = int(settings.num_microbatches)
    data = _Microbatches(x, y, len(x), num_micro, from_data=first == 0)
    loss_fn = parts.task.loss
    if not last:
        with torch.no_grad():
            grad = torch.randn_like(module(x))  # (what the next stage would send back)

        def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # type: ignore[misc]
            return (out * grad).sum()

    params = [p for p in module.parameters() if p.requires_grad]
    runtime = StageRuntime(
        module,
        make_optimizer(cfg.job.optimizer, params),
        stage_idx=0,
        group=None,
        data=data,
        loss_fn=loss_fn,
        in_spec=None,
        out_spec=None,
        options=RuntimeOptions(record_timeline=False, track_memory=settings.memory_check != "off"),
        emulator=SpeedEmulator(speed),
    )
    schedule = make_schedule(ScheduleKind.GPIPE, 1, num_micro)
    for _ in range(2):  # (warm-up, before the others start too)
        runtime.run(schedule)
    barrier.wait(timeout=180.0)
    times: list[float] = []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop or len(times) < 5:
        t0 = time.perf_counter()
        runtime.run(schedule)
        times.append(time.perf_counter() - t0)
    return times


class _Microbatches:
    """A stage's microbatches (``pipeline/runtime_inputs.StageData``): the same rows every time;
    the first stage copies them out of the data set's tensors as the run's ``BatchData`` does."""

    def __init__(self, x: Any, y: Any, size: int, num_micro: int, *, from_data: bool) -> None:
        self.x, self.y, self.size, self.num_micro, self.from_data = x, y, size, num_micro, from_data

    def batch_size(self, microbatch_idx: int) -> int:
        return self.size

    def input(self, microbatch_idx: int) -> Any:
        if self.from_data:
            return self.x.clone()
        # (an activation from the stage before: its gradient is computed, to be sent back)
        return self.x.detach().requires_grad_(self.x.is_floating_point())

    def target(self, microbatch_idx: int) -> Any:
        return self.y.clone()

    def loss_scale(self, microbatch_idx: int) -> float:
        return 1.0 / self.num_micro
