"""``hetpipe``'s launcher side (``sync/stage_plug.py``): the parameter-server shards the virtual
workers (VWs) sync through, hosted in the launcher's process for the whole run:

- ``ps_shards`` shards (``ps/server.py``) on the cluster's host address, WSP(s_local, D) with the
  delta rule (the stages push the sums of their own updates), one worker per VW (a VW's stages
  are the parts of its clock: ``ps/client_parts.py``), seeded with the task's initial weights
  (every VW starts from them, as every stage builds the task with ``job.seed``);
- a lost VW (``lost``: its processes are gone -- lost, or its newcomers given up before they
  were in -- whichever worker id it held: its first, or the one it came back as) is declared
  dead on every shard -- its last return's id barred (a hello still on its way is refused),
  every id it holds fenced everywhere, then its staged
  clock committed or discarded up to the highest clock any shard committed
  (``two_phase.resolution_target``) and the VW evicted -- so the others' pulls are no longer
  held back by it and no shard keeps half a wave;
- the job's weights are the shards' state at the end (``final_state``, read in this process);
- the summary gains the stages' staleness figures and shard 0's data views (``summary``: which
  VWs split the batches of which waves, and the slices an evicted VW left untrained);
- **checkpoints** (``HostContext.snapshots``: ``<report>/ps-snapshots``, ``checkpoint.every_steps``
  / ``every_s`` or every 10 steps by default): the shards' snapshots (``ps/server_snapshots.py``:
  weights, clocks, data views; atomic), also at the end; the VWs' unpushed local updates and
  their optimizers' state are not in them.  **Resume** (``flotilla run --resume DIR``): the
  snapshots found in ``DIR`` are cut into this job's shards (``ps/snapshot_sets.cut``, the rules
  ``ps/reshard.py``: one clock ``resume_at``, the highest any shard reached, so no sample is
  trained twice; a VW that stood behind it has its slices in between dropped, said in a warning)
  and every stage of every VW -- any placement, any number of VWs -- starts at wave
  ``resume_at`` from the global weights (``services["resume_at"]``: ``HetPipePlug.start_step``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from flotilla.comm.msgplane import serve
from flotilla.core.errors import ConfigError
from flotilla.core.log import get_logger
from flotilla.ps.client import PSClient, keys_of
from flotilla.ps.consistency import WSP, s_global
from flotilla.ps.server import PSServer
from flotilla.ps.sharding import DEFAULT_CHUNK_BYTES, plan_shards
from flotilla.ps.snapshot import SnapshotPolicy
from flotilla.ps.snapshot_sets import Cut, cut, find_snapshots, say_behind, set_aside
from flotilla.ps.store import DeltaUpdate, ShardConfig
from flotilla.ps.two_phase import resolution_target
from flotilla.sync.hetpipe_stage import worker_id_of
from flotilla.sync.stage_plug import HostContext

__all__ = ["HetPipeHost", "shard_state"]

log = get_logger("hetpipe")
SEEDER_ID = 1_000_000  # the launcher's client id when it seeds the shards (it never joins the job)


def shard_state(
    servers: Sequence[PSServer], like: Mapping[str, torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> dict[str, torch.Tensor]:
    """The parameters ``like`` names (their shapes, dtypes) as the shards ``servers`` (this
    process's, chunked as ``ps/sharding.plan_shards`` chunks them) hold them now."""
    plan = plan_shards(keys_of(like), len(servers), chunk_bytes=chunk_bytes)
    out = {n: torch.zeros_like(t) for n, t in like.items()}
    flats = {n: t.view(-1) for n, t in out.items()}
    for s, server in enumerate(servers):
        ids = [cid for cid, shard in enumerate(plan.assignment) if shard == s]
        for cid, t in zip(ids, server.read_local(ids)):
            c = plan.chunks[cid]
            flats[c.key][c.offset_elems : c.offset_elems + c.num_elems].copy_(t)
    return out


class HetPipeHost:
    """The shards of one ``hetpipe`` run (module doc); ``close`` stops them."""

    def __init__(self, settings: Any, ctx: HostContext) -> None:
        self.wsp = WSP(s_local=int(settings.s_local), clock_distance=int(settings.clock_distance))
        self.num_instances = ctx.num_instances
        self.snapshots = ctx.snapshots is not None
        self.initial = {n: p.detach().cpu().clone() for n, p in ctx.model.named_parameters()}
        n = int(settings.ps_shards)
        configs = [
            ShardConfig(
                shard_index=i,
                num_shards=n,
                num_workers=ctx.num_instances,
                consistency=self.wsp,
                update=DeltaUpdate(),
            )
            for i in range(n)
        ]
        self.servers: list[PSServer] = []
        self.resumed: Cut | None = None
        policy = self._snapshots(ctx, configs[0]) if ctx.snapshots is not None else None
        try:
            for i, cfg in enumerate(configs):
                bind = f"tcp://{ctx.host}:0"
                plane = serve(ctx.secret, bind, name=f"hetpipe-shard{i}")
                self.servers.append(PSServer(cfg, plane, snapshots=policy).start())
            self.addresses = [s.address for s in self.servers]
            seeder = PSClient(self.addresses, ctx.secret, worker_id=SEEDER_ID, keys=keys_of(self.initial))
            try:
                seeder.initialize(self.initial)
            finally:
                seeder.close()
        except BaseException:
            self.close()
            raise
        self.services: dict[str, Any] = {"ps": list(self.addresses)}
        if self.resumed is not None:  # (every stage learns its VW's first wave from the servers)
            self.services["resume_at"] = self.resumed.resume_at
        self.evicted: list[int] = []
        log.info(
            "hetpipe: %d parameter-server shard(s) at %s, WSP %s", n, ", ".join(self.addresses), self.wsp
        )

    def _snapshots(self, ctx: HostContext, template: ShardConfig) -> SnapshotPolicy:
        """The shards' snapshot policy (module doc); with ``ctx.resume_dir``, the snapshots found
        there first cut into this job's shards where they resume from (``self.resumed``)."""
        assert ctx.snapshots is not None
        wave = self.wsp.wave_size
        if ctx.resume_dir is not None:
            label = f"--resume {ctx.resume_dir}"
            source = find_snapshots(ctx.resume_dir)
            if source is None:
                raise ConfigError(f"{label}: no parameter-server snapshot in it or in its ps-snapshots/")
            keys = keys_of(self.initial)
            self.resumed = cut(
                source, template, keys, ctx.snapshots, label, wave_size=wave, total_steps=ctx.total_steps
            )
            log.warning(
                "hetpipe: resuming from %s: %d shard(s) cut into %d, every virtual worker from wave %d "
                "(step %d) with the global weights; the stages' optimizers start afresh",
                self.resumed.source,
                self.resumed.num_shards,
                template.num_shards,
                self.resumed.resume_at,
                self.resumed.resume_at * wave,
            )
            say_behind(self.resumed)
        else:
            set_aside(ctx.snapshots)  # (a fresh run: a previous run's set is kept in .prev)
        # (a shard's version grows by one per VW clock it applies: num_instances per wave)
        every = max(1, round(ctx.every_steps * ctx.num_instances / wave)) if ctx.every_steps else 0
        return SnapshotPolicy(directory=ctx.snapshots, every_versions=every, every_s=ctx.every_s)

    def lost(self, instance: int, arrival: int = 0) -> None:
        """Declare VW ``instance`` dead on every shard (module doc): every worker id it holds
        there (``id % num_instances == instance``: its first, or the one it came back as).  The
        id of its last return (``arrival``; 0: none) is barred first, so the hello of a newcomer
        given up that is still on its way is refused rather than joining a job nobody evicts it
        from (``PSServer.bar_local``)."""
        if arrival:
            wid = worker_id_of(instance, arrival, self.num_instances)
            if any([s.bar_local(wid) for s in self.servers]):
                log.info("hetpipe: worker %d (virtual worker %d's return %d) barred", wid, instance, arrival)
        held = {w for s in self.servers for w in s.workers_local() if w % self.num_instances == instance}
        for worker in sorted(held):
            self._evict(instance, worker)

    def _evict(self, instance: int, worker: int) -> None:
        committed = [c for c in (s.fence_local(worker) for s in self.servers) if c is not None]
        if not committed:
            return
        target = resolution_target(committed)
        outcomes = [s.resolve_local(worker, target) for s in self.servers]
        self.evicted.append(instance)
        log.warning(
            "hetpipe: virtual worker %d (worker %d) evicted at clock %d (its staged wave: %s)",
            instance,
            worker,
            target,
            outcomes,
        )

    def final_state(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters as the shards hold them now."""
        return shard_state(self.servers, self.initial)

    def summary(self, stages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The stages' staleness figures, per VW and for the job."""
        figures = [s["hetpipe"] for s in stages if isinstance(s.get("hetpipe"), dict)]
        per_vw: dict[int, dict[str, Any]] = {}
        for f in figures:
            vw = per_vw.setdefault(int(f["vw"]), {"vw": int(f["vw"]), "max_staleness": 0, "gate_wait_s": 0.0})
            vw["max_staleness"] = max(vw["max_staleness"], int(f["max_staleness"]))
            vw["gate_wait_s"] = max(vw["gate_wait_s"], float(f["gate_wait_s"]))
        return {
            "hetpipe": {
                "s_local": self.wsp.s_local,
                "clock_distance": self.wsp.clock_distance,
                "s_global": s_global(self.wsp),
                "max_staleness": max((v["max_staleness"] for v in per_vw.values()), default=0),
                "minibatches_checked": sum(int(f["minibatches_checked"]) for f in figures),
                "virtual_workers": [per_vw[k] for k in sorted(per_vw)],
                "evicted": list(self.evicted),
            },
            **self._resumed(),
            "data_views": self.servers[0].views_local(),  # (ps/data_views.py: views, dropped)
        }

    def _resumed(self) -> dict[str, Any]:
        r = self.resumed
        if r is None:
            return {}
        step = r.resume_at * self.wsp.wave_size
        return {
            "resumed": {"from": str(r.source), "num_shards": r.num_shards, "clock": r.resume_at, "step": step}
        }

    def close(self) -> None:
        for s in self.servers:  # (with snapshots, the final state: a finished job can go on with --resume)
            s.close(final_snapshot=self.snapshots)
