"""A harness for HetPipe virtual workers in one process: each VW is a pipeline of threads (one
per stage, on real gloo groups of its own), every stage a part of its VW on parameter-server
shards served in process (``sync/hetpipe_stage.py``).  VWs may cut the model differently and run
at different emulated speeds (with transient slowdowns)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flotilla.cluster.emulation import SpeedEmulator, TransientSlowdown
from flotilla.comm.collective import EpochGroup
from flotilla.comm.store import StoreHost, connect_store
from flotilla.pipeline.runtime import RuntimeOptions, StageResult, StageRuntime
from flotilla.pipeline.schedule import pipedream
from flotilla.pipeline.split import boundary_specs, split_sequential
from flotilla.ps.client import PSClient, keys_of
from flotilla.ps.client_parts import VWPartClient
from flotilla.ps.consistency import WSP
from flotilla.ps.wsp import MinibatchRecord
from flotilla.sync.hetpipe_plan import WavePlan
from flotilla.sync.hetpipe_stage import WaveSync
from flotilla.sync.stage_plug import model_keys

from .test_pipeline_correctness import BATCH, SEQ, VOCAB, _Data, _data, _loss, _model
from .test_ps_server import FAST, SECRET, servers, shard_configs

LR = 0.05


@dataclass
class VWRun:
    records: dict[tuple[int, int], tuple[MinibatchRecord, ...]] = field(default_factory=dict)  # (vw, stage)
    results: dict[tuple[int, int], StageResult] = field(default_factory=dict)
    losses: dict[int, dict[int, float]] = field(default_factory=dict)  # vw -> minibatch -> loss
    waited_s: dict[tuple[int, int], float] = field(default_factory=dict)
    errors: dict[tuple[int, int], BaseException] = field(default_factory=dict)


def run_vws(
    cuts: list[tuple[int, ...]],
    *,
    s_local: int,
    clock_distance: int,
    steps: int,
    speeds: list[float] | None = None,
    slowdown_p: float = 0.0,
    seed: int = 0,
    server_distance: int | None = None,
    num_shards: int = 2,
    hook: Callable[[int, int, StageRuntime, WaveSync], None] | None = None,
    plan: Callable[[WavePlan], WavePlan] = lambda p: p,
) -> VWRun:
    """Train ``len(cuts)`` VWs (VW v cut at ``cuts[v]``) for ``steps`` minibatches each under
    WSP(s_local, D); ``server_distance`` lets the servers run another D than the stages' plan (a
    broken gate, for a mutation test); ``plan`` may replace a stage's wave plan (a broken stage
    gate); ``hook(vw, stage, runtime, sync)`` runs once a stage is set up (tests wrap its hooks)."""
    k = len(cuts)
    speeds = speeds or [1.0] * k
    full = _model()
    named = {n: p.detach().clone() for n, p in full.named_parameters()}
    distance = clock_distance if server_distance is None else server_distance
    run = VWRun()
    with servers(shard_configs(num_shards, k, WSP(s_local=s_local, clock_distance=distance))) as srvs:
        seeder = PSClient(
            [s.address for s in srvs],
            SECRET,
            worker_id=10_000,
            keys=keys_of(named),
            options=FAST,
            chunk_bytes=1024,
        )
        seeder.initialize(named)
        seeder.close()
        threads: list[threading.Thread] = []
        hosts: list[StoreHost] = []
        try:
            for v, ends in enumerate(cuts):
                x, y = _data(steps, seed=seed * 100 + v + 1)
                data = _Data(x, y, 1)
                specs = boundary_specs(_model(), x[:2], ends)
                host = StoreHost("127.0.0.1")
                hosts.append(host)
                run.losses[v] = {}
                for i in range(len(ends)):
                    args = (run, srvs, host, v, i, ends, specs, data, named, s_local, steps)
                    kw = {
                        "speed": speeds[v],
                        "slowdown_p": slowdown_p,
                        "seed": seed,
                        "k": k,
                        "hook": hook,
                        "plan": plan,
                    }
                    threads.append(threading.Thread(target=_stage, args=args, kwargs=kw, daemon=True))
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not any(t.is_alive() for t in threads), "a stage thread hung"
        finally:
            for h in hosts:
                h.close()
    return run


def _stage(
    run: VWRun, srvs, host, v: int, i: int, ends, specs, data, named, s_local: int, steps: int,
    *, speed: float, slowdown_p: float, seed: int, k: int, hook, plan,
) -> None:  # fmt: skip
    p = len(ends)
    group = EpochGroup(connect_store(host.address), epoch=1, rank=i, world_size=p, timeout_s=60.0)
    try:
        module = split_sequential(_model(), ends)[i]
        keys = model_keys(ends, i, module)
        opt = torch.optim.SGD(module.parameters(), lr=LR)
        slow = TransientSlowdown(p=slowdown_p, factor=4.0, jitter_sigma=0.0, seed=seed * 1000 + v * 10 + i)
        rt = StageRuntime(
            module,
            opt,
            stage_idx=i,
            group=group,
            data=data,
            loss_fn=_loss,
            in_spec=specs[i - 1] if i > 0 else None,
            out_spec=specs[i] if i < p - 1 else None,
            options=RuntimeOptions(record_versions=True, record_timeline=True),
            emulator=SpeedEmulator(speed, slowdown=slow if slowdown_p > 0 else None),
        )
        client = VWPartClient(
            [s.address for s in srvs], SECRET, worker_id=v, keys=keys_of(named), own=set(keys.values()),
            part=i, parts=p, options=FAST, chunk_bytes=1024,
        )  # fmt: skip
        client.hello(0)
        waves = plan(WavePlan(s_local=s_local, num_minibatches=steps))
        sync = WaveSync(rt, client, waves, vw=v, num_vws=k, keys=keys)
        if hook is not None:
            hook(v, i, rt, sync)
        result = rt.run(pipedream(p, steps, in_flight=s_local + 1))
        sync.finish()
        group.barrier()  # (every stage's last vote is in: now the VW may leave)
        if i == 0:
            client.leave(finished=True)
        client.close()
        run.records[(v, i)] = sync.records
        run.results[(v, i)] = result
        run.waited_s[(v, i)] = sync.waited_s
        if i == p - 1:
            run.losses[v] = dict(result.step_losses)
    except BaseException as exc:  # (the test reads it)
        run.errors[(v, i)] = exc
        raise
    finally:
        group.close()


__all__ = ["BATCH", "SEQ", "VOCAB", "VWRun", "run_vws"]
