"""Pipeline runtime correctness: one thread per stage on real gloo groups (SPEC §3.3).

- GPipe and 1F1B-flush produce the same parameter gradients as single-process training on the
  same minibatch (relative tolerance 1e-5), and the same parameters after several steps;
- PipeDream (asynchronous 1F1B): every backward uses exactly the weights its forward used, and those
  are the weights of the version the schedule names (digests of the weights actually used), and
  the final weights equal a naive single-process oracle of PipeDream's semantics;
- vertical sync: every stage uses, for each minibatch, the version stage 0 tagged it with;
- memory: in-flight microbatches and weight copies stay within what the schedule says.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from flotilla.comm.collective import EpochGroup
from flotilla.comm.store import StoreHost, connect_store
from flotilla.data.sampler import shard_bounds
from flotilla.models.zoo import build_model
from flotilla.pipeline.runtime import RuntimeOptions, StageResult, StageRuntime
from flotilla.pipeline.schedule import ScheduleKind, SendAct, make_schedule
from flotilla.pipeline.split import boundary_specs, split_sequential
from flotilla.pipeline.validate import analyze

VOCAB, SEQ, BATCH = 12, 8, 12
LR = 0.05


def _model() -> nn.Sequential:
    """Embedding, 4 blocks, head (6 layers); float64 so that summation order does not matter."""
    return build_model("char_transformer", input_shape=(SEQ,), num_classes=VOCAB, width=16, seed=0).double()


def _data(num_minibatches: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (num_minibatches * BATCH, SEQ), generator=g)
    return x, (x + 1) % VOCAB  # learnable: next char = char + 1


@dataclass
class _Data:
    x: torch.Tensor
    y: torch.Tensor
    m: int

    def _rows(self, b: int) -> slice:
        k, j = divmod(b, self.m)
        lo, hi = shard_bounds(BATCH, j, self.m)
        return slice(k * BATCH + lo, k * BATCH + hi)

    def batch_size(self, b: int) -> int:
        s = self._rows(b)
        return s.stop - s.start

    def input(self, b: int) -> torch.Tensor:
        return self.x[self._rows(b)]

    def target(self, b: int) -> torch.Tensor:
        return self.y[self._rows(b)]

    def loss_scale(self, b: int) -> float:
        return self.batch_size(b) / BATCH


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def run_threads(
    kind: ScheduleKind,
    ends: tuple[int, ...],
    m: int,
    steps: int,
    *,
    vertical_sync: bool = False,
    options: RuntimeOptions = RuntimeOptions(record_versions=True, track_memory=True),
    model: Callable[[], nn.Sequential] = lambda: _model(),
    prepare: Callable[[nn.Module], object] = lambda module: module,
    autocast: Callable[[], AbstractContextManager[object]] = nullcontext,
    data_of: Callable[[int, _Data], object] = lambda i, data: data,
) -> dict:
    """Train ``steps`` minibatches through the pipeline; returns per-stage results, grads, params.
    ``model`` builds the whole model, ``prepare`` is applied to each stage's layers (e.g. compile
    them), ``autocast`` is the stages' forward context (``job.precision``)."""
    p = len(ends)
    x, y = _data(steps)
    schedule = make_schedule(kind, p, 1 if kind is ScheduleKind.PIPEDREAM else m, steps, vertical_sync)
    data = _Data(x, y, schedule.num_microbatches)
    specs = boundary_specs(model(), x[:2], ends)
    host = StoreHost("127.0.0.1")
    out: dict = {"results": {}, "grads": {}, "params": {}, "errors": {}}

    def stage(i: int) -> None:
        group = EpochGroup(connect_store(host.address), epoch=1, rank=i, world_size=p, timeout_s=20.0)
        try:
            module = split_sequential(model(), ends)[i]
            prepare(module)
            opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9)
            rt = StageRuntime(
                module,
                opt,
                stage_idx=i,
                group=group,
                data=data_of(i, data),  # type: ignore[arg-type]
                loss_fn=_loss,
                in_spec=specs[i - 1] if i > 0 else None,
                out_spec=specs[i] if i < p - 1 else None,
                options=options,
                autocast=autocast,
            )
            rt.before_update = lambda v, mod: (
                out["grads"].setdefault(i, {}).__setitem__(v, [q.grad.clone() for q in mod.parameters()])
            )
            out["results"][i] = rt.run(schedule)
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
    out["schedule"], out["x"], out["y"] = schedule, x, y
    return out


def _reference_grads(
    x: torch.Tensor, y: torch.Tensor, steps: int, build: Callable[[], nn.Sequential] = lambda: _model()
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Single-process training: gradient before each step on the whole minibatch, final params."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    grads = []
    for k in range(steps):
        opt.zero_grad()
        _loss(model(x[k * BATCH : (k + 1) * BATCH]), y[k * BATCH : (k + 1) * BATCH]).backward()
        grads.append([q.grad.clone() for q in model.parameters()])
        opt.step()
    return grads, [q.detach().clone() for q in model.parameters()]


def _cat_stages(per_stage: dict[int, list[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for i in sorted(per_stage) for t in per_stage[i]]


@pytest.mark.parametrize("kind", [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B], ids=["gpipe", "1f1b"])
@pytest.mark.parametrize("ends,m", [((2, 6), 4), ((1, 3, 6), 3)], ids=["p2m4", "p3m3"])
def test_flush_schedules_match_single_process_gradients(
    kind: ScheduleKind, ends: tuple[int, ...], m: int
) -> None:
    steps = 3
    run = run_threads(kind, ends, m, steps)
    ref_grads, ref_params = _reference_grads(run["x"], run["y"], steps)
    for k in range(steps):
        got = _cat_stages({i: g[k] for i, g in run["grads"].items()})
        assert len(got) == len(ref_grads[k])
        for a, b in zip(got, ref_grads[k]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-12)
    for a, b in zip(_cat_stages(run["params"]), ref_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-12)
    # the loss the last stage reports is the single-process minibatch loss
    assert set(run["results"][len(ends) - 1].step_losses) == set(range(steps))
    stats = analyze(run["schedule"])
    for i, res in run["results"].items():
        assert res.peak_in_flight == stats.peak_in_flight[i]
        assert res.peak_weight_copies == 1  # flushed schedules never stash
        assert all(r.used_version == r.scheduled_version for r in res.versions)


def _check_stashing(res: StageResult) -> None:
    """Every pass used the weights of the version the schedule names; B used F's exact weights."""
    forward = {}
    for r in res.versions:
        assert r.used_version == r.scheduled_version
        assert r.digest == res.version_digests[r.scheduled_version], (r, "weights differ from the version")
        if r.kind == "F":
            forward[r.microbatch_idx] = r
        else:
            f = forward[r.microbatch_idx]
            assert (r.scheduled_version, r.digest) == (f.scheduled_version, f.digest)


def _pipedream_oracle(run: dict, ends: tuple[int, ...]) -> list[torch.Tensor]:
    """Naive PipeDream: minibatch b's gradient is the whole model's gradient with stage j at the
    version its action list names for b; each stage applies its updates in minibatch order."""
    schedule, x, y = run["schedule"], run["x"], run["y"]
    p = len(ends)
    stages = split_sequential(_model(), ends)
    history = [[[q.detach().clone() for q in s.parameters()]] for s in stages]  # history[j][v]
    opts = [torch.optim.SGD(s.parameters(), lr=LR, momentum=0.9) for s in stages]
    version = [
        {a.microbatch_idx: a.weight_version for a in schedule.stages[j] if type(a).__name__ == "Forward"}
        for j in range(p)
    ]
    for b in range(schedule.num_minibatches):
        leaves = [[w.clone().requires_grad_() for w in history[j][version[j][b]]] for j in range(p)]
        h = x[b * BATCH : (b + 1) * BATCH]
        for j, s in enumerate(stages):
            names = [n for n, _ in s.named_parameters()]
            h = torch.func.functional_call(s, dict(zip(names, leaves[j])), (h,))
        _loss(h, y[b * BATCH : (b + 1) * BATCH]).backward()
        for j, s in enumerate(stages):
            for q, leaf in zip(s.parameters(), leaves[j]):
                q.grad = leaf.grad
            opts[j].step()
            history[j].append([q.detach().clone() for q in s.parameters()])
    return [t for j in range(p) for t in history[j][-1]]


@pytest.mark.parametrize("ends", [(2, 6), (1, 3, 6)], ids=["p2", "p3"])
def test_pipedream_backward_uses_the_stashed_version(ends: tuple[int, ...]) -> None:
    steps = 6
    run = run_threads(ScheduleKind.PIPEDREAM, ends, 1, steps)
    stats = analyze(run["schedule"])
    for i, res in run["results"].items():
        _check_stashing(res)
        assert res.peak_in_flight == stats.peak_in_flight[i] == len(ends) - i
        assert res.peak_weight_copies == stats.peak_weight_versions[i]
    # stage 0 really runs forwards on an older version than the newest while others are pending
    assert any(r.kind == "B" and r.scheduled_version < r.microbatch_idx for r in run["results"][0].versions)
    for a, b in zip(_cat_stages(run["params"]), _pipedream_oracle(run, ends)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-12)


def test_vertical_sync_uses_stage0_version_on_every_stage() -> None:
    ends, steps = (1, 3, 6), 7
    run = run_threads(ScheduleKind.PIPEDREAM, ends, 1, steps, vertical_sync=True)
    tag = {r.microbatch_idx: r.scheduled_version for r in run["results"][0].versions if r.kind == "F"}
    for i, res in run["results"].items():
        _check_stashing(res)
        for r in res.versions:
            assert r.used_version == tag[r.microbatch_idx], (i, r)
    # without vertical sync the last stage would use newer versions than stage 0 for some minibatch
    assert any(r.used_version < r.microbatch_idx for r in run["results"][2].versions)
    for a, b in zip(_cat_stages(run["params"]), _pipedream_oracle(run, ends)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-12)


def test_one_f_one_b_holds_fewer_activations_than_gpipe() -> None:
    runs = {k: run_threads(k, (2, 6), 8, 1) for k in (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B)}
    peak = {k: max(r.peak_activation_bytes for r in run["results"].values()) for k, run in runs.items()}
    assert peak[ScheduleKind.GPIPE] > 0
    assert peak[ScheduleKind.ONE_F_ONE_B] / peak[ScheduleKind.GPIPE] <= 0.3  # 2 of 8 microbatches


def test_a_mismatched_vertical_sync_tag_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    original = StageRuntime._send

    def lying_send(self: StageRuntime, action) -> None:  # stage 0 tags activations with a wrong version
        ctx = (
            self.passes.get(action.microbatch_idx)
            if isinstance(action, SendAct) and self.stage_idx == 0
            else None
        )
        if ctx is None:
            return original(self, action)
        ctx.version += 100
        try:
            return original(self, action)
        finally:
            ctx.version -= 100

    monkeypatch.setattr(StageRuntime, "_send", lying_send)
    with pytest.raises(AssertionError, match="arrived tagged with version 100"):
        run_threads(ScheduleKind.PIPEDREAM, (2, 6), 1, 3, vertical_sync=True, options=RuntimeOptions())


@dataclass
class _StaleSizes:
    """A downstream stage's data whose batch sizes, as it posts receives ahead, are not the ones
    the sender cuts (HetPipe: a data view made after the receive was posted)."""

    data: _Data

    def batch_size(self, b: int) -> int:
        return self.data.batch_size(b) + 1

    def input(self, b: int) -> torch.Tensor:
        return self.data.input(b)

    def target(self, b: int) -> torch.Tensor:
        return self.data.target(b)

    def loss_scale(self, b: int) -> float:
        return self.data.loss_scale(b)


def test_sized_messages_carry_the_senders_batch_whatever_the_receiver_expected() -> None:
    stale = lambda i, data: data if i == 0 else _StaleSizes(data)
    honest = run_threads(ScheduleKind.PIPEDREAM, (2, 4, 6), 1, 6)
    sized = run_threads(
        ScheduleKind.PIPEDREAM, (2, 4, 6), 1, 6, options=RuntimeOptions(sized_messages=True), data_of=stale
    )
    for i in range(3):  # the same training: every tensor arrived whole
        assert all(torch.equal(a, b) for a, b in zip(honest["params"][i], sized["params"][i], strict=True))
    with pytest.raises(AssertionError, match="batch_size|size|Collective"):  # (without the headers)
        run_threads(ScheduleKind.PIPEDREAM, (2, 4, 6), 1, 6, options=RuntimeOptions(), data_of=stale)
