"""``job.precision: fp16`` on pipeline stages (trainer/stage_engine.py, trainer/stage_verdict.py):
two stages, one thread each on a real gloo group, under the one loop, on the CPU (fp16 autocast
runs there).

- with GPipe and 1F1B the stages train close to float32 training, the scale grows alike on both;
- an infinite gradient put into ONE stage at one step (a hook) is agreed by both: both skip that
  step (their weights after it equal a run that stopped before it), both halve their scale, the
  loop counts an overflow, not a non-finite step (``job.nonfinite: stop`` with no allowance goes
  on), and each step's record carries ``loss_scale`` and ``overflow``;
- a stage's scale travels in its state (``export_state`` / ``import_state``: what a re-formed or
  returning instance receives) and in its checkpoint (``--resume``).
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from flotilla.comm.collective import EpochGroup
from flotilla.comm.store import StoreHost, connect_store
from flotilla.core.errors import ConfigError
from flotilla.pipeline.runtime import StageRuntime
from flotilla.pipeline.schedule import ScheduleKind, make_schedule
from flotilla.pipeline.split import boundary_specs, split_sequential
from flotilla.roles.stage_membership import StageMembership
from flotilla.sync.loss_scale import ScaleRule, ScaleState, Verdict
from flotilla.sync.state import model_digest
from flotilla.trainer.boundary import BoundaryPolicy
from flotilla.trainer.loop import EXIT_NONFINITE, Loop, LoopParts
from flotilla.trainer.pipeline_checkpoint import load_stage, restore_loss_scale, stage_checkpointer
from flotilla.trainer.pipeline_job import StageCheckpointPlan
from flotilla.trainer.precision import autocast_of, loss_scaler_of
from flotilla.trainer.stage_engine import StageEngine, StageStrategies

from .test_pipeline_engine import BATCH, ENDS, VOCAB, M, _Data, _Duties, _loss, _model

RULE = ScaleRule(init_scale=2.0**16, growth_interval=3)


class _Records:
    """The loop's unit records (their extra fields) and discarded units."""

    def __init__(self) -> None:
        self.extras: list[dict] = []
        self.discards: list[tuple[int, str]] = []

    def unit(self, res: Any, where: Any, step_s: float, *, flush: bool, extra: dict, digest: Any) -> None:
        self.extras.append(extra)

    def discarded(self, step: int, membership_epoch: int, why: str) -> None:
        self.discards.append((step, why))

    def flush(self) -> None:
        pass


def _stage(i: int, precision: str = "fp16", poison: int = -1) -> tuple[torch.nn.Module, StageRuntime, Any]:
    """Stage ``i``'s float32 layers, its runtime (no group yet) and its data (``poison``: a step
    whose loss is NaN)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (8 * BATCH, 8), generator=g)
    module = split_sequential(_model().float(), ENDS)[i]
    specs = boundary_specs(_model().float(), x[:2], ENDS)
    data = _Data(x, (x + 1) % VOCAB, M, poison)
    rt = StageRuntime(
        module, torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9), stage_idx=i, group=None,
        data=data, loss_fn=_loss, in_spec=specs[i - 1] if i > 0 else None,
        out_spec=specs[i] if i < len(ENDS) - 1 else None,
        autocast=autocast_of(precision, torch.device("cpu")),
    )  # fmt: skip
    return module, rt, data


def run_fp16(
    kind: ScheduleKind,
    steps: int,
    *,
    inf_at: tuple[int, int] | None = None,
    precision: str = "fp16",
    poison: int = -1,
):
    """Train ``steps`` steps on two stages; ``inf_at=(stage, step)``: a hook makes that stage's
    first gradient infinite at that step.  Per stage: exit code, per-step callbacks, unit records,
    the scaler's state, digests after each step."""
    schedule = make_schedule(kind, len(ENDS), M, steps)
    host = StoreHost("127.0.0.1")
    out: dict = {"codes": {}, "steps": {}, "records": {}, "scale": {}, "digests": {}, "errors": {}}

    def stage(i: int) -> None:
        group = EpochGroup(connect_store(host.address), epoch=1, rank=i, world_size=2, timeout_s=20.0)
        try:
            module, rt, _data = _stage(i, precision, poison)
            rt.group = group
            scaler = loss_scaler_of(precision, RULE)
            engine = StageEngine(rt, schedule, group, stage_names=("a", "b"), scaler=scaler)
            if inf_at is not None and inf_at[0] == i:
                first = next(module.parameters())
                first.register_hook(lambda g: torch.full_like(g, math.inf) if engine.step == inf_at[1] else g)
            out["steps"][i], out["digests"][i] = [], []

            def stepped(step: int, loss: float | None, samples: int, nonfinite: str, fields: dict) -> None:
                out["steps"][i].append((step, loss, nonfinite, fields))
                out["digests"][i].append(model_digest(module))

            engine.on_step = stepped
            records = _Records()
            out["records"][i] = records
            policy = BoundaryPolicy(
                total_steps=steps, on_nonfinite="stop", max_nonfinite=0, duties_on_every_rank=True
            )
            loop = Loop(
                LoopParts(
                    membership=StageMembership(i, 2, lambda view, tag: group), engine=engine,
                    strategies=StageStrategies(engine.steps_per_unit), duties=_Duties(engine),
                    records=records, policy=policy,
                )
            )  # fmt: skip
            out["codes"][i] = loop.run()
            out["scale"][i] = scaler.state if scaler is not None else None
        except Exception as exc:  # reported by the test
            out["errors"][i] = repr(exc)
        finally:
            group.close()

    threads = [threading.Thread(target=stage, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    host.close()
    assert not any(t.is_alive() for t in threads), "stage threads hung"
    assert not out["errors"], out["errors"]
    return out


FLUSHING = [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", FLUSHING)
def test_fp16_stages_train_close_to_float32_and_grow_their_scale_alike(kind: ScheduleKind) -> None:
    fp16, fp32 = run_fp16(kind, 7), run_fp16(kind, 7, precision="fp32")
    assert fp16["codes"] == fp32["codes"] == {0: 0, 1: 0}
    losses = [s[1] for s in fp16["steps"][1]]
    ref = [s[1] for s in fp32["steps"][1]]
    assert losses != ref and max(abs(a - b) / b for a, b in zip(losses, ref)) < 0.02  # fp16, close
    assert losses[-1] < losses[0]  # and it trains
    for i in (0, 1):  # every step committed; 2**16 for three steps, then 2**17 (growth_interval 3)
        fields = [s[3] for s in fp16["steps"][i]]
        assert [f["loss_scale"] for f in fields] == [2.0**16] * 3 + [2.0**17] * 3 + [2.0**18]
        assert not any(f["overflow"] or s[2] for f, s in zip(fields, fp16["steps"][i]))
        assert fp16["scale"][i] == ScaleState(scale=2.0**18, good_units=1)
        assert fp32["steps"][i][0][3] == {} and fp32["records"][i].extras[0].get("loss_scale") is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("kind", "stage"), [(ScheduleKind.GPIPE, 0), (ScheduleKind.ONE_F_ONE_B, 1)])
def test_an_overflow_on_one_stage_is_skipped_on_both_and_halves_both_scales(
    kind: ScheduleKind, stage: int
) -> None:
    run = run_fp16(kind, 7, inf_at=(stage, 4))
    assert run["codes"] == {0: 0, 1: 0}  # (on_nonfinite stop, max_nonfinite 0: not a non-finite step)
    for i in (0, 1):
        steps, digests = run["steps"][i], run["digests"][i]
        scales = [s[3]["loss_scale"] for s in steps]
        assert scales == [2.0**16] * 3 + [2.0**17, 2.0**17, 2.0**16, 2.0**16]  # halved at step 4
        assert [s[3]["overflow"] for s in steps] == [False] * 4 + [True, False, False]
        assert all(s[2] == "" for s in steps)  # nothing non-finite
        assert digests[4] == digests[3] and digests[5] != digests[4]  # step 4 applied nothing
        assert run["scale"][i] == ScaleState(scale=2.0**16, good_units=2)
        records = run["records"][i]
        assert [e["overflow"] for e in records.extras] == [False] * 4 + [True, False, False]
        assert records.extras[4]["loss_scale"] == 2.0**17
        assert records.discards == []  # (skipped, not discarded)
    assert run["digests"][0] != run["digests"][1]  # (two stages: their own layers)


@pytest.mark.timeout(120)
def test_a_non_finite_loss_under_fp16_is_still_a_non_finite_step_and_leaves_the_scale() -> None:
    run = run_fp16(ScheduleKind.ONE_F_ONE_B, 5, poison=2)
    assert run["codes"] == {0: EXIT_NONFINITE, 1: EXIT_NONFINITE}
    for i in (0, 1):
        assert [s[2] for s in run["steps"][i]] == ["", "", "loss on stage b"]
        assert run["steps"][i][2][3] == {"loss_scale": 2.0**16, "overflow": False}
        assert run["scale"][i] == ScaleState(scale=2.0**16, good_units=2)  # (not an overflow)


def test_a_stage_scale_travels_in_its_state_and_its_checkpoint(tmp_path: Path) -> None:
    schedule = make_schedule(ScheduleKind.ONE_F_ONE_B, len(ENDS), M, 4)
    src_module, src_rt, _ = _stage(0)
    src = StageEngine(src_rt, schedule, None, scaler=loss_scaler_of("fp16", RULE))  # type: ignore[arg-type]
    dst = StageEngine(_stage(0)[1], schedule, None, scaler=loss_scaler_of("fp16", RULE))  # type: ignore[arg-type]
    assert src.scaler is not None and dst.scaler is not None
    src.scaler.settle(Verdict.OVERFLOW)
    src.scaler.settle(Verdict.GOOD)
    dst.import_state(*src.export_state())  # (what a re-formed or returning instance receives)
    assert dst.scaler.state == ScaleState(scale=2.0**15, good_units=1)

    plan = StageCheckpointPlan(root=tmp_path, every_steps=1, keep=2, fingerprint="f" * 16)
    writer = stage_checkpointer(plan, 0, list(ENDS), [], None, src.scaler)
    writer.write(2, src_module, src_rt.optimizer)
    writer.flush()
    meta = load_stage(tmp_path, 0, 2, "f" * 16).meta
    resumed = loss_scaler_of("fp16", RULE)
    restore_loss_scale(resumed, meta["loss_scale"])
    assert resumed is not None and resumed.state == ScaleState(scale=2.0**15, good_units=1)


def test_a_pipedream_stage_refuses_a_loss_scaler() -> None:
    schedule = make_schedule(ScheduleKind.PIPEDREAM, len(ENDS), 1, 4)
    with pytest.raises(
        ConfigError, match=r"^job.precision: fp16 is not built for strategy pipeline with schedule pipedream"
    ):
        StageEngine(_stage(0)[1], schedule, None, scaler=loss_scaler_of("fp16"))  # type: ignore[arg-type]
