"""One pipeline stage: its parts assembled and run (``run_stage``; its failure reported by
``roles/stage_worker.run_reported``).

The stage process itself is a stage worker (``roles/stage_worker.py``: ``flotilla worker``
joining the pipeline's host, on this machine for ``flotilla run``, on any host for
``flotilla coordinator``); the host hands it the job and its stage process ``G``, placed by
the job's layout (``pipeline/layout.py``: instance by instance -- with one split for all, stage
``G % num_stages`` of instance ``G // num_stages``; a strategy that places its instances, as
hetpipe does, gives each its own split and stage count).  The instance's stage group has the namespace
``pp/<instance>/epoch/<n>/``; with replicas, stage i of every instance also joins the
data-parallel group ``dp/<i>/g<generation>/`` (rank: its instance), over which the stage engine
sums the instances' gradients before each update.

A stage is a worker of the one loop (``trainer/loop.py``); this module only ASSEMBLES its parts:

- the job: ``trainer.pipeline_job.StageJob`` (typed, from the host): the run configuration, the
  store, the split, the stages' names and speeds, output directories, the resume point and the
  checkpoint plan;
- the rendezvous store, authenticated (``comm.store_auth.AuthStore``, as workers use it): every
  value the stage group writes is signed with the cluster secret and a value without a valid
  tag is never read, so a key planted by a process without the secret cannot break the stage
  group's creation;
- Membership: ``StageMembership`` (the fixed stage group), or ``ReplicaMembership`` with replicas
  (``roles/stage_replicas.py``: instances lost and back);
- Engine: ``trainer.stage_engine.StageEngine`` over this stage's layers and the job's schedule
  (a unit is one flush for GPipe/1F1B, the whole remaining schedule for PipeDream), with speed
  emulation and, for ``job.precision: fp16``, the stage's loss scaler (``loss_scaler_of``; the
  configuration refuses fp16 for PipeDream's schedule); the strategy is the no-op ``StageSync``
  (the schedule applies the updates);
- the strategy's stage side, where its spec has one (``sync/stage_plug.py``: e.g. ``hetpipe``'s
  wave sync through the parameter servers, attached to the stage's runtime); with independent
  instances there is no sum across instances and each instance's stage group stands alone; a
  newcomer of an independent instance coming back (``join``) asks the strategy where it starts
  (``StagePlug.start_step``, through ``roles/stage_start.py``) before its parts are built, and
  says it is in (``ready_key`` and ``joined_key`` of its generation) once the strategy's side
  is attached;
- Duties and Records (``roles/stage_parts.py``): per-stage checkpoints, evaluation through the
  pipeline every ``job.eval_every_steps`` steps (flushing schedules), the stage's result, its
  records and status, all through its output (``roles/stage_output.py``: the link to the host);
- faults: a ``core.faults.FaultPlan`` (the worker command reads ``$FLOTILLA_FAULTS``, or the
  legacy ``$FLOTILLA_FAULT_CRASH=NAME@STEP``: crash once STEP steps are done).

Every stage builds the job's task the same way (``pipeline_setup.pipeline_parts``, seeded with
``job.seed``: identical initial weights) and keeps its own layers.  Exit codes: 0 done, 4 a
non-finite value stopped the job (every stage at the same step), 6 out of memory, anything else
an error.  A failing stage reports its cause (``own``, or ``group`` when the stage group broke
under it), so the launcher names the stage whose own error ended the run, not a neighbour that
saw the broken connection first.

Each stage is rank 0 of its own part of the model: it checkpoints its layers and takes part in
every evaluation, so the boundary's rank-0 duties are every stage's (``duties_on_every_rank``).
"""

from __future__ import annotations

import torch

from flotilla.cluster.emulation import SpeedEmulator, no_wait
from flotilla.cluster.membership import View
from flotilla.comm import shaping
from flotilla.comm.auth import read_secret_file
from flotilla.comm.collective import Group
from flotilla.comm.store import StoreAddress, connect_store
from flotilla.config import validate_config
from flotilla.core.faults import FaultInjector, FaultPlan
from flotilla.core.log import get_logger
from flotilla.core.threads import use_torch_threads
from flotilla.pipeline.layout import device_of
from flotilla.pipeline.model_check import split_ties
from flotilla.pipeline.replicas import Generation, joined_key, ready_key
from flotilla.pipeline.runtime import RuntimeOptions, StageRuntime
from flotilla.pipeline.split import boundary_specs, split_sequential
from flotilla.roles.stage_link import JOIN_WAIT_S
from flotilla.roles.stage_membership import StageMembership
from flotilla.roles.stage_memory import StageMemory
from flotilla.roles.stage_output import StageOutput
from flotilla.roles.stage_parts import StageDuties, StageRecords, stage_faults
from flotilla.roles.stage_replicas import Reform, Regroup, ReplicaMembership
from flotilla.roles.stage_start import reshape_of, start_step_of
from flotilla.sync.stage_plug import StageContext, model_keys, stage_plug
from flotilla.trainer import builders, optim
from flotilla.trainer.boundary import BoundaryPolicy
from flotilla.trainer.loop import Loop, LoopParts
from flotilla.trainer.pipeline_job import StageJob
from flotilla.trainer.pipeline_setup import (
    BatchData,
    job_schedule,
    make_sampler,
    pipeline_parts,
    pipeline_strategy,
)
from flotilla.trainer.precision import autocast_of, compile_model, loss_scaler_of
from flotilla.trainer.stage_engine import StageEngine, StageStrategies

__all__ = ["SECRET_FILE", "run_stage"]

SECRET_FILE = "secret"  # in the job's run directory: the cluster secret the launcher wrote

log = get_logger("pipeline-stage")


def run_stage(
    job: StageJob,
    index: int,
    faults: FaultPlan = FaultPlan(),
    join: int = 0,
    *,
    output: StageOutput,
    secret: bytes | None = None,
    arrival: int = 0,
) -> int:
    """Build stage process ``index``'s parts and run the loop; its exit code (module doc).
    ``join``: a newcomer of a pipeline instance coming back, joining generation ``join`` as
    ``arrival`` (its round's serial in the job: ``launch/pipeline_instances.Spawn``).
    ``output``: where its reports go (its caller closes it); ``secret``: the cluster's
    (default: ``<job.run_dir>/secret``, written by the launcher)."""
    cfg = validate_config(job.config)
    use_torch_threads()
    parts = pipeline_parts(cfg)
    place, name = job.place_of(index), job.stage_names[index]
    on = device_of(name)  # (the cluster's worker it runs on: d1~7, of a VW formed again, on d1)
    shaping.install(cfg.cluster.link_shaping(on))  # (cluster.links.emulate: comm/shaping.py)
    ends = list(job.ends_of(place.replica))  # (a placed HetPipe VW: its own split)
    stage_idx, p = place.stage, len(ends)
    device = builders.worker_device(cfg, on)  # (process g runs on cluster.workers[g]'s device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    microbatch = max(1, cfg.job.batch_size // job.replicas // pipeline_strategy(cfg).num_microbatches)
    # (the boundary shapes from one forward of the whole model on the CPU, before the stage's
    # layers move to its device: they are the same modules)
    specs = boundary_specs(parts.model, parts.train.batch(range(microbatch))[0], ends)
    stage = split_sequential(parts.model, ends)[stage_idx].to(device)
    compile_model(stage, cfg.job.compile, cfg.job.compile_backend)
    sampler = make_sampler(cfg, parts.train.num_samples)
    plug = stage_plug(cfg)  # what the strategy adds to its stages (None: a plain pipeline)
    independent = plug is not None and plug.independent_instances  # (no sum across instances)
    if secret is None:
        secret = read_secret_file(job.run_dir / SECRET_FILE)  # (written by the launcher, mode 0600)
    start_step = job.first_step
    if plug is not None:  # (a newcomer of an instance coming back, a resumed job: the strategy says)
        keys = model_keys(ends, stage_idx, stage)
        start_step = start_step_of(
            plug, job, place, join if independent else 0, keys, parts, secret, arrival=arrival
        )
    schedule = job_schedule(cfg, job.total_steps - start_step, p)
    bundle = optim.build_optimizer(cfg, stage, parts.task, total_steps=job.total_steps, clip_locally=False)
    settings = pipeline_strategy(cfg)
    timeout_s = settings.step_timeout_s
    # (a peer may still be joining the host, up to JOIN_WAIT_S; a dead one the host sees and stops)
    rendezvous_s = timeout_s + JOIN_WAIT_S
    budget = int(cfg.cluster.worker(on).memory_bytes)
    store = connect_store(StoreAddress(job.store_host, job.store_port), timeout_s, secret=secret)
    # gloo between stages, CUDA tensors staged through host memory: NCCL's send/recv ignore tags
    # and keep one queue per peer, so a stage's prefetched gradient receive would wait behind
    # the activation it has not sent yet (and no machine with two GPUs was there to test it)
    backend = "gloo"

    def superseded() -> bool:
        """A group of a generation a newer one replaced never forms (pipeline replicas)."""
        return isinstance(membership, ReplicaMembership) and membership.superseded()

    def make_group(view: View, tag: str = "") -> Group:
        return Group(
            store,
            namespace=f"pp/{place.replica}/epoch/{view.epoch}{tag}/",
            rank=stage_idx,
            world_size=p,
            timeout_s=timeout_s,
            rendezvous_timeout_s=rendezvous_s,
            backend=backend,
            device=device,
            cancelled=superseded if job.replicas > 1 and not independent else None,
        )

    def make_replica_group(gen: Generation, rank: int) -> Group:
        """Stage ``stage_idx`` of every instance of ``gen``: the group its gradients are summed over."""
        return Group(
            store,
            namespace=f"dp/{stage_idx}/g{gen.number}{gen.tag}/",
            rank=rank,
            world_size=len(gen.instances),
            timeout_s=timeout_s,
            rendezvous_timeout_s=rendezvous_s,
            backend="gloo",
            device=device,
            cancelled=superseded,
        )

    def make_data(first_step: int, rank: int, world: int) -> BatchData:
        m = schedule.num_microbatches
        return BatchData(parts.train, sampler, m, first_step, rank, world, own_batch=independent)

    membership: StageMembership = (
        StageMembership(stage_idx, p, make_group)
        if job.replicas == 1 or independent
        else ReplicaMembership(
            place, p, make_group, store=store, replicas=job.replicas, timeout_s=timeout_s, joining=join
        )
    )
    if isinstance(membership, ReplicaMembership) and join:
        membership.read_plan()  # (its first groups are the planned generation's, not generation 1's)
    elif join:  # (an independent instance's newcomers: a stage group of their own, not the lost one's)
        membership.view = View(epoch=join, members=membership.view.members)
        membership.tag = f".a{arrival}"  # (a round given up left its keys under the same join)
    records = StageRecords(job, place, sampler, parts.task, output)
    if start_step != job.first_step:  # (the strategy started it later: no earlier losses; a checkpoint's
        records.losses_from = start_step  # resume restores its history from step 0)
    on_nonfinite = cfg.job.nonfinite
    engine: StageEngine | None = None
    duties: StageDuties | None = None
    try:
        group = membership.group(membership.view)
        first = Generation(1, tuple(range(job.replicas)))
        summed = job.replicas > 1 and not join and not independent
        dp_group = make_replica_group(first, place.replica) if summed else None
        runtime = StageRuntime(
            stage,
            bundle.optimizer,
            stage_idx=stage_idx,
            group=group,
            data=(data := make_data(start_step, place.replica, job.replicas)),
            loss_fn=parts.task.loss,
            in_spec=specs[stage_idx - 1] if stage_idx > 0 else None,
            out_spec=specs[stage_idx] if stage_idx < p - 1 else None,
            options=RuntimeOptions(
                track_memory=settings.memory_check != "off",
                sized_messages=plug is not None and plug.sized_messages,
            ),
            emulator=SpeedEmulator(  # (a host wait is not the device's: cluster/emulation.py)
                float(job.speeds[index]), waited=no_wait if device.type == "cuda" else None
            ),
            autocast=autocast_of(cfg.job.precision, device),
            device=device,
        )
        engine = StageEngine(
            runtime,
            schedule,
            group,
            first_step=start_step,
            stage_names=job.names_of(place.replica),
            scheduler=bundle.scheduler,
            halt_on_nonfinite=on_nonfinite == "stop",
            clip_grad_norm=cfg.job.optimizer.clip_grad_norm,
            ties=split_ties(parts.model, ends),
            replica_group=dp_group,
            scaler=loss_scaler_of(cfg.job.precision),  # (fp16: validated for a flushing schedule)
        )
        memory = StageMemory(runtime, budget, settings.memory_check, name)
        records.emulator = runtime.emulator

        def stepped(step: int, loss: float | None, samples: int, nonfinite: str, fields: dict) -> None:
            records.step(step, loss, samples, nonfinite, fields)
            memory.check()
            if duties is not None:
                duties.after_update(step + 1, nonfinite)  # (PipeDream's checkpoints)

        engine.on_step = stepped
        # (a newcomer holds nothing until the running instances send it; one of an independent
        # instance gets what it needs from the strategy's side)
        engine.has_state = not join or independent
        duties = StageDuties(job, engine, records, parts, bundle, on_nonfinite, reshape_of(cfg, job, parts))
        duties.memory = memory
        if plug is not None:
            side = plug.attach(
                StageContext(
                    runtime=runtime,
                    data=data,
                    instance=place.replica,
                    stage=stage_idx,
                    num_instances=job.replicas,
                    num_stages=p,
                    num_minibatches=schedule.num_minibatches,
                    model_keys=model_keys(ends, stage_idx, stage),
                    all_keys=dict(parts.model.named_parameters()),
                    services=job.services,
                    secret=secret,
                    join=join,
                    arrival=arrival,
                    first_step=start_step,
                )
            )
            duties.plug_finish = side.finish
            duties.every_instance_writes = independent
            if join and independent:  # (it is in: the launcher stops counting it as a newcomer)
                store.set(ready_key(join, place.index), "1")
                store.set(joined_key(join, place.index), "1")
                log.info("stage process %d: in the job from step %d (generation %d)", index, start_step, join)
        if isinstance(membership, ReplicaMembership):
            engine.announced = membership.newer_generation
            membership.move_agreed = lambda: engine.move_agreed
            membership.reform = Reform(
                place,
                engine,
                records,
                duties,
                make_replica_group,
                make_data,
                lambda step: job_schedule(cfg, job.total_steps - step, p),
            )
        elif job.replicas == 1 and schedule.kind.flushes:  # (a broken group re-forms: stage_parts.py)
            membership.regroup = Regroup(
                place, engine, records, make_data, lambda step: job_schedule(cfg, job.total_steps - step, p)
            )
        policy = BoundaryPolicy(
            total_steps=job.total_steps,
            on_nonfinite=on_nonfinite,
            max_nonfinite=cfg.job.max_nonfinite,
            eval_every_units=cfg.job.eval_every_steps if schedule.kind.flushes else 0,
            checkpoint_every_steps=job.checkpoint.every_steps if job.checkpoint is not None else 0,
            duties_on_every_rank=True,  # each stage checkpoints its layers, all take part in evaluations
        )
        injector = FaultInjector(stage_faults(faults, name), name)  # (tests: core/faults.py)
        loop = Loop(
            LoopParts(
                membership=membership,
                engine=injector.engine(engine),
                strategies=StageStrategies(
                    engine.steps_per_unit, newcomers=summed or (bool(join) and not independent)
                ),
                duties=duties,
                records=records,
                policy=policy,
                name=name,
            )
        )
        if injector.active:
            loop.boundary_hooks.append(injector.boundary_hook)
        return loop.run()
    except torch.OutOfMemoryError as exc:
        raise builders.out_of_memory(f"stage {stage_idx} ({name!r})", device, exc) from None
    finally:
        if duties is not None:
            try:  # (a checkpoint still being written in the background is finished, not dropped)
                duties.flush_checkpoints()
            except Exception as exc:
                log.error("stage %d: the last checkpoint was not written: %s", stage_idx, exc)
        if engine is not None and engine.replica_group is not None:
            engine.replica_group.close()
        membership.close()
