"""A pipeline stage started on any host: ``flotilla worker --coordinator HOST:PORT`` when the job
there is a pipeline (``docs/multihost.md``, ``docs/pipeline.md``).

It joins the pipeline's host (``roles/stage_link.py``), which gives it its stage process (by its
name, or ``--stage``/``--instance``) and the typed job; waits until every stage process has
joined; then runs the same stage as ``flotilla run`` starts (``run_reported``): the
stage group and replica groups form in the host's rendezvous store, every plane bound on this
host's address that reaches the host (``comm/addresses.py``), and its reports go to the host
(the stage's ``output`` is the link), which writes them as a local stage would.  Its scratch run
directory is a private temporary directory, removed at exit; checkpoints (only with
``checkpoint.every_steps`` set) go under ``checkpoint.dir`` on this host.

When the host says the job is over for it (another stage failed: its group broke) or stays
unreachable, the stage exits at once (status 1) with one line saying why; a stage blocked in a
collective would otherwise wait for its timeout.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from flotilla.comm.addresses import WILDCARDS, reached_where_dialled, split_host_port
from flotilla.core.errors import EXIT_OUT_OF_MEMORY, EXIT_TASK_ERROR, CommError, FlotillaError, OutOfMemory
from flotilla.core.faults import FaultPlan
from flotilla.core.log import get_logger
from flotilla.roles.stage import run_stage
from flotilla.roles.stage_link import StageLink
from flotilla.roles.stage_membership import StageGroupBroke
from flotilla.roles.stage_output import StageOutput
from flotilla.trainer.pipeline_job import StageJob

__all__ = ["run_reported", "run_stage_worker"]

log = get_logger("stage-worker")


def run_stage_worker(
    address: str,
    secret: bytes,
    *,
    name: str | None,
    stage: int | None = None,
    instance: int | None = None,
    faults: FaultPlan = FaultPlan(),
) -> int:
    """Join the pipeline at ``address`` and run the stage it gives this worker; its exit code.
    ConfigError (one line) when the host refuses the join."""
    # (a sender of its own: a second worker claiming the same name must not disturb the holder's)
    link = StageLink(address, secret, sender=f"stage-{name or 'x'}-{os.getpid()}")
    link.on_stop = _exit_now
    try:
        index, raw, join = link.join(name, stage, instance)
        with tempfile.TemporaryDirectory(prefix="flotilla-stage-") as scratch:
            job = StageJob.from_json(json.dumps(raw))
            store_host, dialled = job.store_host, split_host_port(address.removeprefix("tcp://"))[0]
            if store_host in WILDCARDS:  # (a host bound on every interface: reached where we dialled)
                store_host = dialled
            # the strategy's services (hetpipe's servers) bound on every interface: the same rule
            services = reached_where_dialled(job.services, dialled)
            assert isinstance(services, dict)
            job = replace(
                job, run_dir=Path(scratch), report_dir=None, store_host=store_host, services=services
            )
            what = job.layout.describe(index, job.stage_names)
            log.info("runs %s; the job's store at %s:%d", what, store_host, job.store_port)
            link.start()
            link.await_all(what)
            join = join or link.generation  # (hosted: decided once its instance is in)
            return run_reported(job, index, faults, join, output=link, secret=secret, arrival=link.arrival)
    finally:
        link.on_stop = None
        link.close()


def _exit_now(why: str) -> None:
    """The job is over for this stage (module doc): one line, then out, whatever it was doing."""
    log.error("stopping: %s", why)
    logging.shutdown()
    os._exit(1)


def run_reported(
    job: StageJob,
    index: int,
    faults: FaultPlan,
    join: int = 0,
    *,
    output: StageOutput,
    secret: bytes | None = None,
    arrival: int = 0,
) -> int:
    """:func:`run_stage`, its failure reported through ``output`` (``cause``: ``own``, ``group``
    when the stage group broke under it -- another stage's failure --, or ``task`` when its task
    raised under ``job.on_error: stop``), so the launcher names the stage whose own error ended
    the run.  Its exit code: 0 done, 4 stopped on a non-finite value, 6 out of memory, 7 its task
    raised (``job.on_error: stop``: the job stops, traceback in the log), 1 any other failure
    (an unexpected error under ``lose_worker`` is re-raised, its traceback in the log)."""
    t0 = time.perf_counter()
    try:
        code = run_stage(job, index, faults, join, output=output, secret=secret, arrival=arrival)
    except OutOfMemory as exc:  # (the launcher stops the job: no restart would fit it)
        output.failure("own", str(exc))
        log.error("stage %d: %s", index, exc)
        return EXIT_OUT_OF_MEMORY
    except (StageGroupBroke, CommError) as exc:  # another stage's failure broke the group
        output.failure("group", str(exc))
        log.error("stage %d: %s", index, exc)
        return 1
    except FlotillaError as exc:
        output.failure("own", str(exc))
        log.error("stage %d: %s", index, exc)
        return 1
    except Exception as exc:  # this stage's own error: the launcher names it (traceback in the log)
        line = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if job.config.get("job", {}).get("on_error", "stop") != "stop":
            output.failure("own", line)  # (a restart from the checkpoint: job.max_restarts)
            raise
        output.failure("task", f"{line} (the traceback is in its log): the job stops (job.on_error: stop)")
        log.exception("stage %d: the task raised; the job stops (job.on_error: stop)", index)
        return EXIT_TASK_ERROR
    log.info("stage %d done in %.1f s (exit code %d)", index, time.perf_counter() - t0, code)
    return code
