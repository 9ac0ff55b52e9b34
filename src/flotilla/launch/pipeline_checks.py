"""What a pipeline job's schedule cannot train, refused before any stage starts: parameters tied
across two stages under a schedule without flushes (``pipedream``, and so every hetpipe VW),
whose gradient no flush could sum (``pipeline/model_check.py``); microbatches too small for the
model (one sample through BatchNorm, which PyTorch refuses in training).  ``flotilla run``,
``flotilla validate`` and ``flotilla plan`` call the same checks, so they refuse alike.
"""

from __future__ import annotations

from typing import Any

from flotilla.config import RunConfig
from flotilla.core.errors import ConfigError
from flotilla.pipeline.model_check import refuse_split_ties
from flotilla.pipeline.schedule import ScheduleKind
from flotilla.pipeline.split import layer_ends_of
from flotilla.trainer.builders import min_samples
from flotilla.trainer.pipeline_setup import pipeline_strategy

__all__ = ["refuse_small_microbatches", "refuse_ties", "schedule_flushes"]


def schedule_flushes(cfg: RunConfig) -> bool:
    """Whether the job's pipeline schedule flushes (gpipe, 1f1b; not pipedream)."""
    return ScheduleKind(pipeline_strategy(cfg).schedule).flushes


def refuse_ties(cfg: RunConfig, model: Any, plans: list[Any]) -> None:
    """ConfigError (one line, before any stage starts) if a schedule without flushes would run a
    split of ``plans`` that puts tied parameters in two stages (``pipeline/model_check.py``)."""
    if schedule_flushes(cfg):
        return
    st = pipeline_strategy(cfg)
    fix = "use schedule gpipe or 1f1b"
    if st.kind != "pipeline":  # (its schedule is fixed: hetpipe's VWs run pipedream)
        fix = (
            f"strategy {st.kind} runs every pipeline with it: give each layer its own tensor, or "
            "train with strategy pipeline and schedule gpipe or 1f1b"
        )
    for plan in plans:
        refuse_split_ties(model, layer_ends_of(plan), st.schedule, fix=fix)


def refuse_small_microbatches(cfg: RunConfig, model: Any, instances: int) -> None:
    """ConfigError if the smallest microbatch -- ``job.batch_size`` over ``instances`` pipeline
    instances, then over the schedule's microbatches (one per minibatch under ``pipedream``) --
    holds fewer samples than the model trains on (``builders.min_samples``: 2 with BatchNorm)."""
    need = min_samples(model)
    if need < 2:
        return
    st = pipeline_strategy(cfg)
    m = st.num_microbatches if schedule_flushes(cfg) else 1
    share = cfg.job.batch_size // max(1, instances)
    if share // m >= need:
        return
    over = f" over {instances} pipeline instances" if instances > 1 else ""
    fix = f"use at most {share // need} microbatches or " if m > 1 and share >= need else ""
    raise ConfigError(
        f"strategy.num_microbatches: a microbatch holds {share // m} sample(s) (job.batch_size "
        f"{cfg.job.batch_size}{over}, {m} microbatch(es) each), and the model has BatchNorm, which "
        f"trains on {need} at least (PyTorch refuses one in training): {fix}a larger job.batch_size"
    )
