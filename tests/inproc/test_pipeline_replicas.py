"""Pipeline instances side by side (``strategy.replicas``; PP x DP): two 2-stage pipelines in
threads on real gloo groups -- each instance's stage group ``pp/<r>/...``, each stage's replica
group ``dp/<i>/`` -- against one pipeline over the whole batch.

- the two instances, each on half of every batch, train what one pipeline trains on the whole
  batch (the same microbatch size; float64, so within rounding), for both flushing schedules, and
  end bitwise identical;
- a loss that is not finite on ONE instance stops every stage of BOTH at that step with nothing of
  it applied (the verdict is agreed across the instances);
- ``skip`` skips that step on both and they stay identical;
- re-forming after a lost instance (``roles/stage_replicas.Reform``) hands the most advanced
  survivor's state (weights, optimizer, step, loss history) to the others.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import pytest
import torch

from flotilla.comm.collective import Group
from flotilla.comm.store import StoreHost, connect_store
from flotilla.pipeline.replicas import Generation, StagePlace
from flotilla.pipeline.runtime import StageRuntime
from flotilla.pipeline.schedule import ScheduleKind, make_schedule
from flotilla.pipeline.split import boundary_specs, split_sequential
from flotilla.roles.stage_membership import StageMembership
from flotilla.roles.stage_replicas import Reform
from flotilla.sync.state import model_digest
from flotilla.trainer.boundary import BoundaryPolicy
from flotilla.trainer.loop import EXIT_NONFINITE, Loop, LoopParts
from flotilla.trainer.stage_engine import StageEngine, StageStrategies

from .test_pipeline_engine import ENDS, SEQ, VOCAB, _Duties, _loss, _model, _Records

BATCH = 12  # the global batch


@dataclass
class _Part:
    """Instance ``replica`` of ``replicas``: microbatch b is part ``b % m`` of its contiguous share
    of step ``b // m``'s global batch; its loss is scaled by its share of the GLOBAL batch."""

    x: torch.Tensor
    y: torch.Tensor
    m: int
    replica: int = 0
    replicas: int = 1
    poison: int = -1  # a step whose loss this instance makes NaN

    def _rows(self, b: int) -> slice:
        k, j = divmod(b, self.m)
        share = BATCH // self.replicas
        size = share // self.m
        lo = k * BATCH + self.replica * share + j * size
        return slice(lo, lo + size)

    def batch_size(self, b: int) -> int:
        return BATCH // self.replicas // self.m

    def input(self, b: int) -> torch.Tensor:
        return self.x[self._rows(b)]

    def target(self, b: int) -> torch.Tensor:
        return self.y[self._rows(b)]

    def loss_scale(self, b: int) -> float:
        return math.nan if b // self.m == self.poison else self.batch_size(b) / BATCH


def run_instances(
    kind: ScheduleKind,
    steps: int,
    replicas: int,
    m: int,
    *,
    poison: tuple[int, int] = (-1, -1),
    nonfinite="stop",
) -> dict:
    """``replicas`` instances of the 2-stage pipeline, ``m`` microbatches each; ``poison``:
    (instance, step) whose loss is NaN.  Per (instance, stage): exit code, parameters, digest."""
    p = len(ENDS)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (steps * BATCH, SEQ), generator=g)
    schedule = make_schedule(kind, p, m, steps)
    specs = boundary_specs(_model(), x[:2], ENDS)
    host = StoreHost("127.0.0.1")
    out: dict = {"codes": {}, "params": {}, "digests": {}, "stopped": {}, "errors": {}}

    def stage(r: int, i: int) -> None:
        store = connect_store(host.address)
        group = Group(store, namespace=f"pp/{r}/epoch/1/", rank=i, world_size=p, timeout_s=20.0)
        dp = (
            Group(store, namespace=f"dp/{i}/", rank=r, world_size=replicas, timeout_s=20.0)
            if replicas > 1
            else None
        )
        try:
            module = split_sequential(_model(), ENDS)[i]
            opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
            data = _Part(x, (x + 1) % VOCAB, m, r, replicas, poison[1] if poison[0] == r else -1)
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
            engine = StageEngine(
                rt,
                schedule,
                group,
                stage_names=("a", "b"),
                halt_on_nonfinite=nonfinite == "stop",
                replica_group=dp,
            )
            duties = _Duties(engine)
            policy = BoundaryPolicy(total_steps=steps, on_nonfinite=nonfinite, duties_on_every_rank=True)
            loop = Loop(
                LoopParts(
                    membership=StageMembership(i, p, lambda view, tag: group),
                    engine=engine,
                    strategies=StageStrategies(engine.steps_per_unit),
                    duties=duties,
                    records=_Records(),
                    policy=policy,
                )
            )
            out["codes"][r, i] = loop.run()
            out["stopped"][r, i] = duties.stopped
            out["params"][r, i] = [q.detach().clone() for q in module.parameters()]
            out["digests"][r, i] = model_digest(module)
        except Exception as exc:  # reported by the test
            out["errors"][r, i] = repr(exc)
        finally:
            if dp is not None:
                dp.close()
            group.close()

    threads = [
        threading.Thread(target=stage, args=(r, i), daemon=True) for r in range(replicas) for i in range(p)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    host.close()
    assert not any(t.is_alive() for t in threads), "stage threads hung"
    assert not out["errors"], out["errors"]
    return out


def _identical_instances(out: dict) -> None:
    for (r, i), digest in out["digests"].items():
        assert digest == out["digests"][0, i], f"instance {r}'s stage {i} differs from instance 0's"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B])
def test_two_instances_train_what_one_pipeline_trains_on_the_whole_batch(kind: ScheduleKind) -> None:
    two = run_instances(kind, 4, replicas=2, m=2)
    assert set(two["codes"].values()) == {0}
    _identical_instances(two)
    one = run_instances(kind, 4, replicas=1, m=4)  # (the same microbatch size: 3 samples)
    for i in range(len(ENDS)):
        for a, b in zip(two["params"][0, i], one["params"][0, i], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    # and not a coincidence of an update that changes nothing: the weights moved
    untrained = split_sequential(_model(), ENDS)
    assert any(
        not torch.equal(a, b)
        for i in range(len(ENDS))
        for a, b in zip(one["params"][0, i], untrained[i].parameters())
    )


@pytest.mark.timeout(180)
def test_a_non_finite_loss_on_one_instance_stops_every_stage_of_both_with_nothing_applied() -> None:
    stopped = run_instances(ScheduleKind.ONE_F_ONE_B, 5, replicas=2, m=2, poison=(1, 2))
    assert set(stopped["codes"].values()) == {EXIT_NONFINITE}
    assert {v[0] for v in stopped["stopped"].values()} == {2}  # every stage of both, at step 2
    _identical_instances(stopped)
    two_steps = run_instances(ScheduleKind.ONE_F_ONE_B, 2, replicas=2, m=2)  # step 2 never applied
    assert stopped["digests"] == two_steps["digests"]


@pytest.mark.timeout(180)
def test_skip_skips_the_step_on_both_instances_and_they_stay_identical() -> None:
    skipped = run_instances(ScheduleKind.GPIPE, 4, replicas=2, m=2, poison=(0, 1), nonfinite="skip")
    assert set(skipped["codes"].values()) == {0}
    _identical_instances(skipped)
    clean = run_instances(ScheduleKind.GPIPE, 4, replicas=2, m=2)
    assert skipped["digests"] != clean["digests"]  # (step 1 was skipped, not applied)


@dataclass
class _Losses:
    losses: list[float]


@dataclass
class _Lead:
    lead: bool = False


@pytest.mark.timeout(120)
def test_re_forming_after_a_loss_hands_the_most_advanced_state_to_the_others() -> None:
    """Two surviving one-stage instances, one a step ahead (it applied a step whose sum broke for
    the other): after ``Reform`` both hold the advanced weights, optimizer state, step and loss
    history, train on from there with their new shares, and instance 0 (the lowest) leads."""
    host = StoreHost("127.0.0.1")
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (8 * BATCH, SEQ), generator=g)
    out: dict = {"errors": {}, "digests": {}, "steps": {}, "losses": {}, "lead": {}, "shares": {}}

    def instance(r: int) -> None:
        store = connect_store(host.address)
        module = _model()  # (one stage: the whole model)
        opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
        schedule = make_schedule(ScheduleKind.GPIPE, 1, 2, 8)
        group = Group(store, namespace=f"pp/{r}/epoch/1/", rank=0, world_size=1, timeout_s=20.0)
        rt = StageRuntime(
            module, opt, stage_idx=0, group=group, data=_Part(x, (x + 1) % VOCAB, 2, r, 2), loss_fn=_loss,
            in_spec=None, out_spec=None,
        )  # fmt: skip
        engine = StageEngine(rt, schedule, group)
        engine.step = 3 if r == 1 else 2  # (instance 1 applied step 2, instance 0 did not)
        if r == 1:
            with torch.no_grad():
                for q in module.parameters():
                    q.add_(0.01)
        records, duties = _Losses([1.0, 0.9, 0.8][: engine.step]), _Lead()
        made: list[tuple[int, int, int]] = []

        def data(first: int, rank: int, world: int) -> _Part:
            made.append((first, rank, world))
            return _Part(x, (x + 1) % VOCAB, 2, rank, world)

        reform = Reform(
            StagePlace(r, 0, r),
            engine,
            records,  # type: ignore[arg-type]
            duties,  # type: ignore[arg-type]
            lambda gen, rank: Group(
                store, namespace=f"dp/0/g{gen.number}/", rank=rank, world_size=2, timeout_s=20.0
            ),
            data,  # type: ignore[arg-type]
            lambda first: make_schedule(ScheduleKind.GPIPE, 1, 2, 8 - first),
        )
        try:
            new = Group(store, namespace=f"pp/{r}/epoch/2/", rank=0, world_size=1, timeout_s=20.0)
            reform(Generation(2, (0, 1)), new)
            out["digests"][r], out["steps"][r] = model_digest(module), engine.step
            out["losses"][r], out["lead"][r], out["shares"][r] = list(records.losses), duties.lead, made
            assert engine.first_step == 3 and engine.schedule.num_minibatches == 5 and engine.group is new
        except Exception as exc:  # reported by the test
            out["errors"][r] = repr(exc)
        finally:
            if engine.replica_group is not None:
                engine.replica_group.close()
            group.close()

    threads = [threading.Thread(target=instance, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    host.close()
    assert not out["errors"], out["errors"]
    assert out["steps"] == {0: 3, 1: 3} and out["digests"][0] == out["digests"][1]
    assert out["losses"] == {0: [1.0, 0.9, 0.8], 1: [1.0, 0.9, 0.8]}
    assert out["lead"] == {0: True, 1: False} and out["shares"] == {0: [(3, 0, 2)], 1: [(3, 1, 2)]}


@pytest.mark.timeout(60)
def test_a_gradient_only_one_instance_has_is_summed_on_both_and_none_stays_none() -> None:
    """A data-dependent branch: instance 0 has a gradient for parameter ``b``, instance 1 none;
    ``c`` has none anywhere.  After the sum both hold ``b``'s gradient (instance 1's zeros added)
    and ``c`` keeps none on both, so both apply the same update."""
    host = StoreHost("127.0.0.1")
    out: dict = {"errors": {}, "grads": {}}

    def instance(r: int) -> None:
        store = connect_store(host.address)
        module = torch.nn.ModuleDict(
            {"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2), "c": torch.nn.Linear(2, 2)}
        )
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        dp = Group(store, namespace="dp/0/g1/", rank=r, world_size=2, timeout_s=20.0)
        try:
            empty = _Part(torch.zeros(1), torch.zeros(1), 1)
            rt = StageRuntime(
                module, opt, stage_idx=0, group=None, data=empty, loss_fn=_loss, in_spec=None, out_spec=None
            )
            engine = StageEngine(rt, make_schedule(ScheduleKind.GPIPE, 1, 1, 1), dp, replica_group=dp)
            x = torch.ones(1, 2) * (r + 1)
            y = module["a"](x) if r else module["b"](module["a"](x))
            y.sum().backward()
            rt.step_losses = {0: 0.5 * (r + 1)}  # (each instance's share of the step's loss)
            engine._sum_replicas(0, "")
            out.setdefault("losses", {})[r] = rt.step_losses[0]
            out["grads"][r] = {
                n: (None if p.grad is None else p.grad.clone()) for n, p in module.named_parameters()
            }
        except Exception as exc:  # reported by the test
            out["errors"][r] = repr(exc)
        finally:
            dp.close()

    threads = [threading.Thread(target=instance, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=40)
    host.close()
    assert not out["errors"], out["errors"]
    g0, g1 = out["grads"][0], out["grads"][1]
    assert g0["c.weight"] is None and g1["c.weight"] is None
    assert g0["b.weight"] is not None and g1["b.weight"] is not None
    for name in g0:
        if g0[name] is not None:
            torch.testing.assert_close(g0[name], g1[name], rtol=0, atol=0)
    assert bool(g0["b.weight"].abs().sum() > 0)
    assert out["losses"] == {0: 1.5, 1: 1.5}  # (the last stage's loss: the sum of the shares)
