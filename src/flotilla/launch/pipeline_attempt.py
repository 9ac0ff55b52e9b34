"""One attempt of a pipeline job: the rendezvous store, one process per stage, supervised to its end.

``flotilla.launch.pipeline`` runs the restart loop around :func:`attempt`; this module starts and
watches the stages of one attempt:

- a fresh host per attempt (``roles/stage_host.py``, as ``flotilla coordinator`` hosts a
  pipeline whose stages run anywhere): the rendezvous store, whose every value the stages sign
  and verify with the cluster secret (``<run_dir>/secret``, mode 0600, written by
  :func:`write_run_secret`), so a key planted by a process without the secret never reaches a
  stage's group creation; and the message plane the stages join and report through (the host
  writes their status, result and failure files into the run directory, their records into
  the report directory);
- the typed job (``pipeline_job.StageJob``, also kept in ``<run_dir>/pipeline_job.json``) and
  one ``flotilla worker --coordinator HOST:PORT --name NAME`` per stage process through the
  run's ``Supervisor`` (own session, dies with its parent): the same stage worker a user starts
  on another host (``roles/stage_worker.py``);
- :func:`supervise` until every stage exited 0, or stopped on a non-finite value (exit code 4,
  every stage at the same step), or a stage failed (``pipeline_watch.StageFailure``, naming the
  stage whose own error caused it); every stage of the attempt has exited or been killed, and
  been reaped, when :func:`attempt` returns or raises.  With ``strategy.replicas`` > 1 a failed
  stage whose loss leaves another instance whole is not a failure of the attempt: its instance
  is dropped and the survivors train on (``launch/pipeline_instances.py``).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flotilla.comm.auth import generate_secret, read_secret_file, write_secret_file
from flotilla.config import RunConfig, WorkerSpec
from flotilla.core.atomic_io import atomic_write_json
from flotilla.core.errors import EXIT_OUT_OF_MEMORY, EXIT_TASK_ERROR, FlotillaError
from flotilla.core.log import get_logger
from flotilla.launch.pipeline_instance_log import InstanceLog
from flotilla.launch.pipeline_instances import InstanceWatch
from flotilla.launch.pipeline_reform import Reformer, stuck_line
from flotilla.launch.pipeline_watch import (
    Restarts,
    StageFailure,
    broke_under,
    failure_line,
    reached_step,
    snapshot,
    stop_line,
)
from flotilla.launch.progress import Progress
from flotilla.launch.supervisor import Child, Supervisor
from flotilla.pipeline.layout import device_of
from flotilla.roles.stage import SECRET_FILE
from flotilla.roles.stage_host import StageHost
from flotilla.trainer.loop import EXIT_NONFINITE
from flotilla.trainer.pipeline_job import StageJob
from flotilla.trainer.pipeline_setup import pipeline_strategy

__all__ = ["AttemptEnd", "attempt", "supervise", "write_run_secret"]

log = get_logger("pipeline-job")

# A stage that failed because its group broke under it (another stage's failure) is acted on only
# this long after its exit, or once the stage that caused it exited: the cause decides what follows
# (an out-of-memory stops the job, a killed stage restarts it or drops its instance).
GROUP_GRACE_S = 2.0


@dataclass(frozen=True)
class AttemptEnd:
    """How an attempt ended: ``stopped``, the line of a non-finite stop ("" when every stage
    finished); ``instances``, the surviving pipeline instances and the losses."""

    stopped: str
    instances: InstanceWatch
    job: StageJob  # (its instances formed again on other processes included: launch/pipeline_reform.py)


def write_run_secret(run_dir: Path) -> Path:
    """A fresh cluster secret in ``<run_dir>/secret`` (0600, in a run directory made 0700)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(run_dir, 0o700)
    path = run_dir / SECRET_FILE
    write_secret_file(path, generate_secret())
    return path


def attempt(
    sup: Supervisor,
    cfg: RunConfig,
    job: StageJob,
    display: Progress,
    start: float,
    restarts: Restarts,
    history: InstanceLog | None = None,
    *,
    on_lost: Callable[[int, int], None] | None = None,
    bring_back: bool = True,
    alone: bool = False,
    reform: Reformer | None = None,
) -> AttemptEnd:
    """One start of every stage (with a fresh rendezvous store), supervised to its end (see
    :func:`supervise`); every stage of it has exited or been killed, and been reaped, when this
    returns or raises.  ``history``: where the pipeline instances this attempt loses and brings
    back are recorded; ``on_lost(instance, arrival)``: told of each lost instance (``arrival``: its
    last return's, 0: none); ``bring_back``: False when a lost instance may not come back
    (independent instances: ``sync/stage_plug.py``); ``alone``: the instances are independent (their
    state held elsewhere): with all of them lost while one can come back, the attempt waits for
    it (``InstanceWatch.alone``); ``reform``: a lost instance may come back formed again on other
    devices (``launch/pipeline_reform.py``: new stage processes, the job and its host told)."""
    settle_s = pipeline_strategy(cfg).step_timeout_s
    secret = read_secret_file(job.run_dir / SECRET_FILE)
    host = StageHost(
        job,
        secret,
        host=cfg.cluster.host,
        heartbeat_timeout_s=cfg.cluster.heartbeat_timeout_s,
        store_timeout_s=settle_s,
        report=cfg.report,
    ).start()
    job = host.job  # (the store's address filled in)
    atomic_write_json(job.run_dir / "pipeline_job.json", job.to_dict())

    workers = [cfg.cluster.worker(n) for n in job.stage_names]  # (process g: stage<g> files)

    def spawn(index: int, join: int, arrival: int) -> Child:
        # (a newcomer in a dead process's place: pipeline/replicas.py)
        host.release(index, join, arrival=arrival)
        return _start_stage(sup, job, host.address, index, join)

    def reshape(instance: int, lost_by: str | None, live: tuple[int, ...]) -> Any:
        nonlocal job
        got = reform(job, instance, lost_by, live) if reform is not None else None
        if got is None or isinstance(got, str):
            return got
        why = f"pipeline instance {instance} was formed again on other devices"
        host.reformed(got, list(job.layout.processes(instance)), why)
        job = host.job
        atomic_write_json(job.run_dir / "pipeline_job.json", job.to_dict())
        workers.extend(
            cfg.cluster.worker(device_of(n)).model_copy(update={"name": n})
            for n in job.stage_names[len(workers) :]
        )
        return job.stage_names, job.layout

    watch = InstanceWatch(
        list(job.stage_names),
        job.layout,
        store=host.store_address,
        secret=secret,
        timeout_s=settle_s,
        history=history if history is not None else InstanceLog(),
        spawn=spawn if bring_back else None,
        budget=cfg.job.max_restarts,
        on_lost=on_lost,
        alone=alone,
        reshape=reshape if reform is not None else None,
        devices=reform,
    )
    try:
        for i in range(len(job.stage_names)):
            _start_stage(sup, job, host.address, i)
        stopped = supervise(sup, job.run_dir, workers, display, start, settle_s, restarts, watch, host)
        return AttemptEnd(stopped, watch, job)
    finally:
        sup.stop("stage", grace_s=0.0)  # on success every stage has exited already: this only reaps
        sup.reap()  # (the stages killed here: not reported as failures of the next attempt)
        host.close()


def _start_stage(sup: Supervisor, job: StageJob, address: str, index: int, join: int = 0) -> Child:
    """Stage process ``index``: a stage worker joining the attempt's host at ``address`` (``join``:
    a newcomer of an instance coming back, joining that generation -- the host tells it; its log
    ``stage<G>.join<N>.log``)."""
    name, secret = job.stage_names[index], job.run_dir / SECRET_FILE
    cmd = [
        sys.executable,
        "-m",
        "flotilla.cli.main",
        "worker",
        "--coordinator",
        address.removeprefix("tcp://"),
    ]
    cmd += ["--secret-file", str(secret), "--name", name]
    if join:  # (a newcomer: not the dead process's status and failure files)
        for suffix in ("status.json", "failure.json"):
            (job.run_dir / f"stage{index}.{suffix}").unlink(missing_ok=True)
    log_name = f"stage{index}" + (f".join{join}" if join else "")
    return sup.spawn(job.stage_names[index], cmd, role="stage", log_name=log_name)


def supervise(
    sup: Supervisor,
    run_dir: Path,
    workers: list[WorkerSpec],
    display: Progress,
    start: float,
    settle_s: float,
    restarts: Restarts,
    instances: InstanceWatch | None = None,
    host: StageHost | None = None,
) -> str:
    """Until every stage exited 0 (returns "") or stopped on a non-finite value (returns the
    stopping line); StageFailure naming the stage whose error CAUSED the failure otherwise --
    at once (the caller kills the others) when ``restarts`` allows a restart.

    A stage that fails breaks the stage group, so the others fail too, sometimes first: a stage
    whose group broke under it is held ``GROUP_GRACE_S`` for its cause's exit; once a stage failed
    of its own cause (``stage<I>.failure.json``: not a broken group) or was killed, it is named at
    once (the caller kills the others: a stage waiting to re-form its group with a dead mate would
    hold the run for the collectives' timeout); with only broken groups, the launcher lets the
    others exit (at most ``settle_s``, the collectives' timeout) and names the first that failed.
    ``host``: a stage it finds silent for ``cluster.heartbeat_timeout_s`` (frozen, hung: its
    neighbours would wait for the collectives' timeout) is killed, its failure in its own name.
    ``instances``: with pipeline replicas, a stage of an instance already lost, or whose loss
    leaves another instance whole, is not a failure (``InstanceWatch``)."""
    stopped: dict[int, str] = {}  # stage index -> its line
    held: list[tuple[float, Child]] = []  # failed because their group broke: acted on after the cause
    failed: list[Child] = []
    forced = False  # (a failed stage failed of its own cause, or was killed: not a free restart)
    cause_known = False  # (a stage failed of its own cause, or was killed: nobody else can be it)
    # (the instances' names: grown in place when an instance is formed again on new processes)
    names = instances.names if instances is not None else [w.name for w in workers]
    settle_until = math.inf
    while True:
        # before reaping: a stage that exits now is seen below (newcomers not in yet do not count)
        waiting = instances.waiting_newcomers() if instances is not None else []
        finished = not [c for c in sup.alive("stage") if not any(c is w for w in waiting)]
        now, batch = time.monotonic(), []
        for c in sup.reap():
            # (out of memory: no restart would fit it; the task raised, job.on_error: stop)
            if c.returncode in (EXIT_OUT_OF_MEMORY, EXIT_TASK_ERROR) and c.name in names:
                raise FlotillaError(failure_line(run_dir, names, [c]))
            if c.returncode not in (0, EXIT_NONFINITE) and c.name in names and broke_under(run_dir, names, c):
                held.append((now + GROUP_GRACE_S, c))  # (its group broke: the cause's exit first)
            else:
                batch.append(c)
        due = [c for t, c in held if t <= now or finished]
        held = [(t, c) for t, c in held if not (t <= now or finished)]
        for c in [*batch, *due]:
            lost = c.returncode not in (0, EXIT_NONFINITE) and c.name in names
            # (its group broke and no mate's own exit came first within the grace: nobody failed)
            unforced = any(c is d for d in due) and c.returncode is not None and c.returncode > 0
            forced = forced or (lost and not unforced)  # (an own failure or a kill: no free restart)
            if (
                lost
                and instances is not None
                and instances.handles(sup, c, reached_step(run_dir, len(names)), nobody_failed=unforced)
            ):
                continue
            if lost and instances is not None and instances.unable:  # (none can be formed again:
                raise FlotillaError(stuck_line(instances))  # a restart would place on devices gone)
            if c.returncode == EXIT_NONFINITE and c.name in names:
                stopped[names.index(c.name)] = stop_line(run_dir, names.index(c.name), c)
            elif c.returncode != 0:
                failed.append(c)
                cause_known = cause_known or not any(c is d for d in due)
                free = not forced  # (every stage that failed in this attempt: its group broke)
                settle_until = min(settle_until, time.monotonic() + settle_s)
                if restarts.allowed(reached := reached_step(run_dir, len(names)), nobody_failed=free):
                    raise StageFailure(failure_line(run_dir, names, [c]), c, reached, nobody_failed=free)
        if failed and (finished or cause_known or time.monotonic() > settle_until):
            line = failure_line(run_dir, names, failed)
            raise StageFailure(line, failed[0], reached_step(run_dir, len(names)), nobody_failed=not forced)
        # (the exits above handled: every instance lost while one comes back -- instances that
        # stand alone, their state held elsewhere -- is no end, nor is a generation of only the
        # instance coming back; at the end, the newcomers not in yet are dropped before a poll
        # could announce them)
        end = finished and (instances is None or instances.trains())
        if end and instances is not None:
            instances.drop_waiting()
        if host is not None:
            _kill_silent(sup, host, names)
        if instances is not None and not end:
            instances.poll(sup, reached_step(run_dir, len(names)))
            if finished and not instances.goes_on():  # (every instance lost, none can come back)
                raise FlotillaError(stuck_line(instances))
        snap = snapshot(run_dir, workers, start, instances.layout if instances is not None else None)
        restarts.see(snap)
        display.update(snap)
        if end:
            return stopped[max(stopped)] if stopped else ""  # the stage nearest the loss knows most
        time.sleep(0.2)


def _kill_silent(sup: Supervisor, host: StageHost, names: list[str]) -> None:
    """SIGKILL the stage processes the host finds silent (see :func:`supervise`)."""
    for g in host.view().silent:
        child = next((c for c in sup.alive("stage") if c.name == names[g]), None)
        if child is not None:
            log.warning("pipeline stage %s: %s", names[g], host.mark_silent(g))
            child.proc.kill()  # (through its handle: never a process that took its pid since)
