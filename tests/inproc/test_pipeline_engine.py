"""The stage engine under the one loop: one thread per stage on real gloo groups.

- unit by unit (one flush per unit, or PipeDream's whole schedule) the loop trains exactly what
  ``StageRuntime.run`` over the whole schedule trains;
- a non-finite loss at step k stops every stage at step k (exit code 4) with nothing of step k
  applied -- the weights equal a run of k steps -- for the flushing schedules (agreed by the
  all-reduce) and PipeDream (NaN gradients passed upstream); a gradient that is not finite on the
  first stage only is agreed too (flushing schedules); ``skip`` skips the step and goes on;
- evaluation through the pipeline at a flush boundary equals ``evaluate_task`` on the merged model.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from flotilla.comm.collective import EpochGroup
from flotilla.comm.store import StoreHost, connect_store
from flotilla.models.zoo import build_model
from flotilla.pipeline.runtime import StageRuntime
from flotilla.pipeline.schedule import ScheduleKind, make_schedule
from flotilla.pipeline.split import boundary_specs, split_sequential
from flotilla.roles.stage_membership import StageMembership
from flotilla.trainer.boundary import BoundaryPolicy
from flotilla.trainer.loop import EXIT_NONFINITE, Loop, LoopParts
from flotilla.trainer.stage_engine import StageEngine, StageStrategies
from flotilla.trainer.task_load import TaskData, evaluate_task

VOCAB, SEQ, BATCH, M = 12, 8, 12, 3
ENDS = (3, 6)


def _model() -> nn.Sequential:
    return build_model("char_transformer", input_shape=(SEQ,), num_classes=VOCAB, width=16, seed=0).double()


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


class _Task:
    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _loss(out, y)

    def metrics(self, out: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        return {"accuracy": float((out.argmax(1) == y).double().mean())}


@dataclass
class _Data:
    """Minibatch k = rows [k*BATCH, (k+1)*BATCH); ``poison``: a step whose loss is made NaN."""

    x: torch.Tensor
    y: torch.Tensor
    m: int
    poison: int = -1
    on_input: Callable[[int], None] | None = None

    def _rows(self, b: int) -> slice:
        k, j = divmod(b, self.m)
        size = BATCH // self.m
        return slice(k * BATCH + j * size, k * BATCH + (j + 1) * size)

    def batch_size(self, b: int) -> int:
        return BATCH // self.m

    def input(self, b: int) -> torch.Tensor:
        if self.on_input is not None:
            self.on_input(b // self.m)
        return self.x[self._rows(b)]

    def target(self, b: int) -> torch.Tensor:
        return self.y[self._rows(b)]

    def loss_scale(self, b: int) -> float:
        return math.nan if b // self.m == self.poison else 1.0 / self.m


@dataclass
class _Duties:
    engine: StageEngine
    evals: dict[int, Any] = field(default_factory=dict)
    stopped: tuple[int, str] | None = None

    def restore(self) -> int | None:
        return None

    def restore_lost(self, strategy: Any = None) -> int | None:
        return None

    def checkpoint(self, step: int, strategy: Any, *, agreed: bool) -> None:
        pass

    def local_checkpoint(self, step: int, strategy: Any, rank: int) -> None:
        pass

    def evaluate(self, step: int, strategy: Any) -> None:
        self.evals[step] = self.engine.evaluate(_Task(), _eval_data())

    def finish(self, step: int, strategy: Any, rank: int, *, agreed: bool) -> int:
        self.engine.finish()
        self.engine.group.barrier()
        return 0

    def nonfinite(self, step: int, what: str, own: bool = False) -> None:
        self.stopped = (self.engine.nonfinite_step, self.engine.nonfinite)


class _Records:
    def unit(self, *args: Any, **kwargs: Any) -> None:
        pass

    def discarded(self, step: int, membership_epoch: int, why: str) -> None:
        pass

    def flush(self) -> None:
        pass


def _eval_data() -> TaskData:
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, VOCAB, (40, SEQ), generator=g)
    return TaskData((x, (x + 1) % VOCAB))


def run_stages(
    kind: ScheduleKind,
    steps: int,
    *,
    poison: int = -1,
    grad_poison: int = -1,
    nonfinite: str = "stop",
    eval_every: int = 0,
    whole_run: bool = False,
) -> dict:
    """Train ``steps`` minibatches through the loop (or ``StageRuntime.run``, ``whole_run``)."""
    p = len(ENDS)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (steps * BATCH, SEQ), generator=g)
    m = 1 if kind is ScheduleKind.PIPEDREAM else M
    schedule = make_schedule(kind, p, m, steps)
    specs = boundary_specs(_model(), x[:2], ENDS)
    host = StoreHost("127.0.0.1")
    out: dict = {"codes": {}, "params": {}, "duties": {}, "engines": {}, "errors": {}}

    def stage(i: int) -> None:
        group = EpochGroup(connect_store(host.address), epoch=1, rank=i, world_size=p, timeout_s=20.0)
        try:
            module = split_sequential(_model(), ENDS)[i]
            opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
            data = _Data(x, (x + 1) % VOCAB, m, poison)
            if i == 0 and grad_poison >= 0:
                _poison_grads(module, data, grad_poison)
            rt = StageRuntime(
                module,
                opt,
                stage_idx=i,
                group=group,
                data=data,
                loss_fn=_loss,
                in_spec=specs[i - 1] if i > 0 else None,
                out_spec=specs[i] if i < p - 1 else None,
            )
            if whole_run:
                rt.run(schedule)
                out["codes"][i] = 0
            else:
                out["codes"][i] = _loop(rt, schedule, group, i, p, nonfinite, eval_every, out).run()
            out["params"][i] = [q.detach().clone() for q in module.parameters()]
        except Exception as exc:  # reported by the test
            out["errors"][i] = repr(exc)
        finally:
            group.close()

    threads = [threading.Thread(target=stage, args=(i,), daemon=True) for i in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    host.close()
    assert not any(t.is_alive() for t in threads), "stage threads hung"
    assert not out["errors"], out["errors"]
    return out


def _loop(
    rt: StageRuntime,
    schedule: Any,
    group: EpochGroup,
    i: int,
    p: int,
    nonfinite: str,
    eval_every: int,
    out: dict,
) -> Loop:
    engine = StageEngine(rt, schedule, group, stage_names=("a", "b"), halt_on_nonfinite=nonfinite == "stop")
    duties = _Duties(engine)
    out["duties"][i], out["engines"][i] = duties, engine
    policy = BoundaryPolicy(
        total_steps=schedule.num_minibatches,
        on_nonfinite=nonfinite,
        eval_every_units=eval_every,
        duties_on_every_rank=True,
    )
    return Loop(
        LoopParts(
            membership=StageMembership(i, p, lambda view, tag: group),
            engine=engine,
            strategies=StageStrategies(engine.steps_per_unit),
            duties=duties,
            records=_Records(),
            policy=policy,
        )
    )


def _poison_grads(module: nn.Module, data: _Data, step: int) -> None:
    """Stage 0's first weight gets a NaN gradient in ``step`` (its loss stays finite)."""
    current = {"step": -1}
    data.on_input = lambda k: current.__setitem__("step", k)
    weight = next(module.parameters())
    weight.register_hook(lambda grad: grad * math.nan if current["step"] == step else grad)


def _same(a: dict, b: dict) -> None:
    for i in a["params"]:
        for pa, pb in zip(a["params"][i], b["params"][i], strict=True):
            torch.testing.assert_close(pa, pb, rtol=0, atol=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(ScheduleKind))
def test_the_loop_trains_what_the_whole_schedule_trains(kind: ScheduleKind) -> None:
    looped = run_stages(kind, 4)
    assert looped["codes"] == {0: 0, 1: 0}
    _same(looped, run_stages(kind, 4, whole_run=True))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(ScheduleKind))
def test_a_non_finite_loss_stops_every_stage_at_its_step_with_nothing_applied(kind: ScheduleKind) -> None:
    stopped = run_stages(kind, 6, poison=2)
    assert stopped["codes"] == {0: EXIT_NONFINITE, 1: EXIT_NONFINITE}
    first = "loss on stage b" if kind.flushes else "gradient received from stage b"  # PipeDream: NaN goes up
    assert [stopped["duties"][i].stopped for i in (0, 1)] == [(2, first), (2, "loss on stage b")]
    _same(stopped, run_stages(kind, 2))  # the weights after 2 steps: step 2 was never applied


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B])
def test_a_gradient_that_is_not_finite_on_the_first_stage_is_agreed(kind: ScheduleKind) -> None:
    stopped = run_stages(kind, 4, grad_poison=1)
    assert stopped["codes"] == {0: EXIT_NONFINITE, 1: EXIT_NONFINITE}
    assert [stopped["duties"][i].stopped for i in (0, 1)] == [(1, "gradient on stage a")] * 2
    _same(stopped, run_stages(kind, 1))


@pytest.mark.timeout(120)
def test_skip_drops_the_non_finite_step_and_goes_on() -> None:
    res = run_stages(ScheduleKind.ONE_F_ONE_B, 4, poison=1, nonfinite="skip")
    assert res["codes"] == {0: 0, 1: 0}
    assert all(e._skipped == {1: "loss on stage b"} for e in res["engines"].values())
    assert all(bool(torch.isfinite(q).all()) for ps in res["params"].values() for q in ps)


@pytest.mark.timeout(120)
def test_evaluation_through_the_pipeline_equals_the_merged_model() -> None:
    res = run_stages(ScheduleKind.ONE_F_ONE_B, 4, eval_every=2)
    assert res["duties"][0].evals == {2: None}  # every stage took part; the first returns nothing
    got = res["duties"][1].evals[2]
    two = run_stages(ScheduleKind.ONE_F_ONE_B, 2)
    model = _model()
    for i, module in enumerate(split_sequential(model, ENDS)):
        for q, value in zip(module.parameters(), two["params"][i], strict=True):
            q.data.copy_(value)
    want = evaluate_task(_Task(), model, _eval_data())
    assert got == pytest.approx(want, rel=1e-12)
