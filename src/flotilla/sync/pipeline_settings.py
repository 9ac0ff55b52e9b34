"""Strategy ``pipeline``'s settings and spec: pipeline model parallelism (SPEC §3).  Its stages
run their own engine (``trainer/stage_engine.py``, launched by ``launch/pipeline.py``): the spec has
no data-parallel worker strategy (``build`` is None) and asks for the pipeline runner.

``replicas: R`` runs R instances of the pipeline on disjoint workers (PP x DP): instance r's stage
i is ``cluster.workers[r * num_stages + i]``; each instance takes 1/R of every global batch and
each stage's gradients are summed with the same stage of the other instances before the update
(``trainer/stage_engine.py``).  Flushing schedules only (``gpipe``, ``1f1b``).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from flotilla.cluster.launch_plan import LaunchNeeds, Runner
from flotilla.sync.spec import RunFacts, StrategySettings, StrategySpec, settings_error

__all__ = ["SPEC", "PipelineStrategy"]


class PipelineStrategy(StrategySettings):
    """Pipeline model parallelism (SPEC §3)."""

    kind: Literal["pipeline"] = "pipeline"
    # a checkpoint of P stages resumes as Q, re-partitioned (trainer/pipeline_checkpoint.py)
    shape_fields: ClassVar[frozenset[str]] = frozenset(
        {"num_stages", "num_microbatches", "schedule", "split_points", "replicas"}
    )
    schedule: Literal["gpipe", "1f1b", "pipedream"] = "1f1b"
    num_stages: int = Field(default=2, ge=1, le=64)
    num_microbatches: int = Field(default=8, ge=1, le=4096)
    vertical_sync: bool = False
    # pipeline instances on disjoint workers, data parallel between them (PP x DP; module doc)
    replicas: int = Field(default=1, ge=1, le=64)
    # where a model that is not an nn.Sequential is cut into layers (module names, forward order;
    # pipeline/trace.py); None: at every module start where one tensor crosses
    split_points: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, max_length=4096)
    step_timeout_s: float = Field(default=60.0, gt=0, le=86400)
    # each stage's measured memory against its device's budget (roles/stage_memory.py); it changes
    # nothing in the trained state (not in the checkpoint fingerprint)
    free_fields: ClassVar[frozenset[str]] = frozenset({"memory_check"})
    memory_check: Literal["warn", "fail", "off"] = "warn"

    @field_validator("memory_check", mode="before")
    @classmethod
    def _off(cls, value: Any) -> Any:
        return "off" if value is False else value  # (YAML reads a bare off as false)

    def collective_timeout_s(self) -> float:
        return self.step_timeout_s

    def in_flight(self) -> int | None:
        """PipeDream's minibatches in flight on the first stage (None: the number of stages)."""
        return None

    @property
    def num_processes(self) -> int:
        """Stage processes of the job: ``num_stages`` per instance, ``replicas`` instances."""
        return self.num_stages * self.replicas


def check_workers(settings: Any, facts: RunFacts, unit: str) -> None:
    """One cluster worker per stage of every pipeline instance (``unit``: what an instance is
    called in the message)."""
    s, r = settings.num_stages, settings.replicas
    if facts.num_workers != s * r:
        raise settings_error(
            "replicas",
            f"num_stages x replicas ({s} x {r} = {s * r}) must equal the number of cluster workers "
            f"({facts.num_workers}): stage i of {unit} k runs on cluster.workers[k * num_stages + i]",
        )


def _check(settings: Any, facts: RunFacts) -> None:
    """PP x DP: flushing schedules only; every instance's share of a batch fills its microbatches."""
    r = settings.replicas
    if r > 1 and settings.schedule == "pipedream":
        raise settings_error(
            "replicas",
            f"must be 1 with schedule pipedream (it has no flush to reduce the instances' "
            f"gradients at; use gpipe or 1f1b), got {r}",
        )
    if r > 1:
        check_workers(settings, facts, "instance")
    if r > 1 and settings.num_microbatches > facts.batch_size // r:
        raise settings_error(
            "num_microbatches",
            f"must be <= each instance's share of job.batch_size ({facts.batch_size} over "
            f"{r} replicas = {facts.batch_size // r}), got {settings.num_microbatches}",
        )


SPEC = StrategySpec(
    kind="pipeline",
    settings=PipelineStrategy,
    summary="pipeline parallelism: GPipe / 1F1B / PipeDream (weight stashing, vertical sync)",
    check=_check,
    launch=LaunchNeeds(runner=Runner.PIPELINE, revocations=False, gpu=True),
    simulated="flotilla.sim.pipeline:pipeline_of",
)
