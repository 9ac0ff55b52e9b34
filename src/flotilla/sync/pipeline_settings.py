"""Strategy ``pipeline``'s settings and spec: pipeline model parallelism (SPEC §3).  Its stages
run their own engine (``trainer/stage_engine.py``, launched by ``launch/pipeline.py``): the spec has
no data-parallel worker strategy (``build`` is None) and asks for the pipeline runner.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from flotilla.cluster.launch_plan import LaunchNeeds, Runner
from flotilla.sync.spec import StrategySettings, StrategySpec

__all__ = ["SPEC", "PipelineStrategy"]


class PipelineStrategy(StrategySettings):
    """Pipeline model parallelism (SPEC §3)."""

    kind: Literal["pipeline"] = "pipeline"
    # a checkpoint of P stages resumes as Q, re-partitioned (trainer/pipeline_checkpoint.py)
    shape_fields: ClassVar[frozenset[str]] = frozenset(
        {"num_stages", "num_microbatches", "schedule", "split_points"}
    )
    schedule: Literal["gpipe", "1f1b", "pipedream"] = "1f1b"
    num_stages: int = Field(default=2, ge=1, le=64)
    num_microbatches: int = Field(default=8, ge=1, le=4096)
    vertical_sync: bool = False
    # where a model that is not an nn.Sequential is cut into layers (module names, forward order;
    # pipeline/trace.py); None: at every module start where one tensor crosses
    split_points: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, max_length=4096)
    step_timeout_s: float = Field(default=60.0, gt=0, le=86400)

    def collective_timeout_s(self) -> float:
        return self.step_timeout_s


SPEC = StrategySpec(
    kind="pipeline",
    settings=PipelineStrategy,
    summary="pipeline parallelism: GPipe / 1F1B / PipeDream (weight stashing, vertical sync)",
    launch=LaunchNeeds(runner=Runner.PIPELINE, revocations=False, gpu=True),
)
