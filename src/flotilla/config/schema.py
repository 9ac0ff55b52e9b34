"""Typed run configuration: the pydantic v2 models behind a flotilla YAML file.

A run file has four sections -- ``cluster``, ``job``, ``strategy``, ``report`` -- each a model in
its own module (``cluster.py``, ``job.py``, ``strategy.py``; shared pieces in ``base.py``), and
:class:`RunConfig` here is their root (this module re-exports the section models).  Loading and
``--set`` overrides live in :mod:`flotilla.config.load`, one-line error messages in
:mod:`flotilla.config.messages`.

Invariants:
- every model forbids unknown keys and is frozen (collections are tuples), so a validated
  ``RunConfig`` can be shared and hashed;
- sizes (``*_bytes``) accept an int or a string such as ``"512MiB"`` / ``"1.5GB"`` and are stored as
  whole, positive numbers of bytes; floats must be finite;
- choices are tagged unions on ``kind`` (:data:`Strategy`, :data:`Optimizer`); the strategy union is
  the strategy registry (``sync/registry.py``): a strategy declares its settings model in its spec,
  and its spec's ``check`` (what the settings need from the rest of the run) runs here, so
  ``flotilla validate`` refuses what ``flotilla run`` would;
- custom validators raise ``PydanticCustomError(CONFIG_ERROR_TYPE, "{message}", ctx)`` where ``ctx``
  may carry ``field`` (a sub-field of the failing model) so the formatter can name it precisely.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import Field, model_validator

from flotilla.cluster.launch_plan import LaunchInput, LaunchPlan, launch_plan
from flotilla.config.base import CONFIG_ERROR_TYPE, Size, _fail, _Model, format_size, parse_size
from flotilla.config.cluster import (
    ClusterConfig,
    WorkerDefaults,
    WorkerEntry,
    WorkerSpec,
)
from flotilla.config.job import AdamOptimizer, DatasetConfig, JobConfig, ModelConfig, Optimizer, SGDOptimizer
from flotilla.config.strategy import AllReduceStrategy, PipelineStrategy, PSStrategy, Strategy
from flotilla.sync import registry
from flotilla.sync.loss_scale import stage_fp16_refusal
from flotilla.sync.spec import RunFacts, SettingsError, StrategySettings, StrategySpec

__all__ = [
    "CheckpointConfig",
    "CONFIG_ERROR_TYPE",
    "PSStrategy",
    "PipelineStrategy",
    "AdamOptimizer",
    "AllReduceStrategy",
    "ClusterConfig",
    "DatasetConfig",
    "JobConfig",
    "ModelConfig",
    "Optimizer",
    "ReportConfig",
    "RunConfig",
    "SGDOptimizer",
    "Size",
    "Strategy",
    "WorkerDefaults",
    "WorkerEntry",
    "WorkerSpec",
    "format_size",
    "parse_size",
]

# --------------------------------------------------------------------------------------- report


class ReportConfig(_Model):
    """What the run reports and how often."""

    metrics_every_steps: int = Field(default=1, ge=1)
    # a parameter digest in the metrics every N steps (replicas' digests must agree); 0 = never.
    # Hashing every parameter byte costs ~20 % of a small model's step: not every step by default.
    digest_every_steps: int = Field(default=100, ge=0)
    # experiment trackers written live (report/trackers.py): null = TensorBoard when installed
    trackers: list[Literal["tensorboard", "mlflow"]] | None = None
    # MLflow: a tracking URI (http://host:5000, sqlite:///x.db, a path); null = <report>/mlruns
    mlflow_uri: str | None = Field(default=None, min_length=1, max_length=4096)
    mlflow_experiment: str = Field(default="flotilla", min_length=1, max_length=500)


class CheckpointConfig(_Model):
    """Durable checkpoints of the committed state (docs/checkpoints.md): every ``every_steps``
    committed steps and/or every ``every_s`` seconds, into ``dir`` (relative paths: to the run's
    report or run directory), keeping the ``keep`` newest."""

    every_steps: int | None = Field(default=None, ge=1)
    every_s: float | None = Field(default=None, gt=0)
    dir: str = Field(default="checkpoints", min_length=1, max_length=4096)
    keep: int = Field(default=3, ge=1, le=10000)

    @model_validator(mode="after")
    def _check(self) -> CheckpointConfig:
        if self.every_steps is None and self.every_s is None:
            raise _fail("set every_steps, every_s or both (got neither)", "every_steps")
        return self


# ----------------------------------------------------------------------------------------- root


class RunConfig(_Model):
    """A whole run: ``cluster`` and ``job`` are required, ``strategy`` and ``report`` default."""

    cluster: ClusterConfig
    job: JobConfig
    strategy: Strategy = AllReduceStrategy()
    report: ReportConfig = ReportConfig()
    checkpoint: CheckpointConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        num_workers = self.cluster.effective_num_workers()
        if self.job.batch_size < num_workers:
            raise _fail(
                f"must be >= the number of workers ({num_workers}) (got {self.job.batch_size})",
                "job.batch_size",
            )
        self._check_accumulate(num_workers)
        self._check_optimizer()
        self._check_precision()
        self._check_strategy(num_workers)
        return self

    def _check_accumulate(self, num_workers: int) -> None:
        """``job.accumulate`` splits each worker's share of the global batch into equal passes."""
        k, batch = self.job.accumulate, self.job.batch_size
        if k == 1:
            return
        if isinstance(self.strategy, PipelineStrategy):
            raise _fail(
                "cannot be used with strategy pipeline (it splits every batch into "
                "strategy.num_microbatches already: raise that instead)",
                "job.accumulate",
            )
        if batch % (num_workers * k):
            raise _fail(
                f"must divide each worker's share of job.batch_size ({batch} over {num_workers} "
                f"workers{'' if batch % num_workers else f' = {batch // num_workers} each'}) into "
                f"equal passes (got {k})",
                "job.accumulate",
            )

    @property
    def strategy_spec(self) -> StrategySpec:
        """The registered spec of ``strategy.kind``."""
        return registry.spec_of(self.strategy.kind)

    def run_facts(self, num_workers: int | None = None) -> RunFacts:
        """What a strategy spec may know of the rest of the run (``sync.spec.RunFacts``)."""
        return RunFacts(
            num_workers=self.cluster.effective_num_workers() if num_workers is None else num_workers,
            batch_size=self.job.batch_size,
            optimizer_kind=str(self.job.optimizer.kind),
            speeds=tuple(float(w.speed) for w in self.cluster.resolved_workers()),
        )

    def strategy_options(self) -> tuple[StrategySettings, ...]:
        """The strategies the workers run: the job's strategy, or, for a kind that runs others
        (``StrategySpec.options``: ``adaptive``), those it switches between, the first one first."""
        spec = self.strategy_spec
        return spec.options(self.strategy, self.run_facts()) if spec.options is not None else (self.strategy,)

    def _check_strategy(self, num_workers: int) -> None:
        """The strategy spec's own check of its settings against the rest of the run."""
        facts = self.run_facts(num_workers)
        try:
            self.strategy_spec.check(self.strategy, facts)
        except SettingsError as exc:
            field = exc.field if "." in exc.field else f"strategy.{exc.field}"
            raise _fail(exc.message, field) from None

    def _check_precision(self) -> None:
        """fp16 on pipeline stages needs a flush per step (``sync/loss_scale.py``): PipeDream's
        schedule (``pipeline`` with ``schedule: pipedream``, ``hetpipe``) is refused here, so
        nothing starts."""
        st = self.strategy
        if self.job.precision == "fp16" and isinstance(st, PipelineStrategy):
            why = stage_fp16_refusal(st.kind, st.schedule)
            if why:
                raise _fail(why, "job.precision")

    def _check_optimizer(self) -> None:
        """What an optimizer setting needs from the strategy (docs/optimizers.md)."""
        o, st = self.job.optimizer, self.strategy
        servers = isinstance(st, PSStrategy) and st.update == "server_sgd"
        if o.clip_grad_norm is not None and servers:
            raise _fail(
                "cannot be used with strategy.update 'server_sgd' (the servers step on the sum of "
                "the pushes; nobody sees the global gradient to clip); use update: delta",
                "job.optimizer.clip_grad_norm",
            )
        if o.clip_grad_norm is not None and isinstance(st, PipelineStrategy) and st.schedule == "pipedream":
            raise _fail(
                "cannot be used with strategy.schedule 'pipedream' (no flush at which the stages "
                "could agree on the global norm); use schedule gpipe or 1f1b",
                "job.optimizer.clip_grad_norm",
            )
        if servers and o.weight_decay > 0 and o.weight_decay_on == "weights":
            raise _fail(
                "'weights' cannot be used with strategy.update 'server_sgd' (the servers decay "
                "every parameter); set weight_decay_on: all, or use update: delta",
                "job.optimizer.weight_decay_on",
            )

    def fingerprint(self) -> str:
        """What a checkpoint's state depends on, as a short hex digest: the job (task, optimizer,
        global batch, seed; not its length or evaluation period) and the strategy (kind and its
        settings; not its timeouts nor its ``shape_fields``, e.g. a pipeline's stage count, nor its
        ``free_fields``, e.g. a pipeline's memory check), not the cluster."""
        text = json.dumps(self.fingerprint_data(), sort_keys=True)
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def data_fingerprint(self) -> str:
        """What decides which samples step k draws (the task and its data, the seed, the global
        batch), as a short hex digest: a parameter server's snapshots carry it, so a job resumed
        from them with other data is refused (``ps/reshard.py``)."""
        name, args = self.job.task_spec()
        data = {"task": name, "args": args, "seed": self.job.seed, "batch_size": self.job.batch_size}
        text = json.dumps(data, sort_keys=True, default=str)
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def fingerprint_data(self) -> dict[str, Any]:
        """The settings :meth:`fingerprint` digests, as plain JSON data (what a checkpoint records
        so that a resume with other settings can name them)."""
        data = self.to_dict()
        free = (
            "steps",
            "epochs",
            "eval_every_steps",
            "nonfinite",
            "max_nonfinite",
            "on_error",
            "auto_checkpoint",
            "max_restarts",
            "accumulate",  # (the same update in fewer or more passes)
        )  # state does not depend on them
        job = {k: v for k, v in data["job"].items() if k not in free}
        shape = self.strategy.shape_fields | self.strategy.free_fields
        strategy = {
            k: v for k, v in data["strategy"].items() if not k.endswith("timeout_s") and k not in shape
        }
        return {"job": job, "strategy": strategy}

    def launch_plan(self, *, resume: bool = False) -> LaunchPlan:
        """The processes this job needs and what its strategy allows (``cluster/launch_plan.py``)."""
        st = self.strategy
        return launch_plan(
            LaunchInput(
                kind=st.kind,
                needs=st.launch_needs(self.strategy_spec.launch),
                workers=tuple(w.name for w in self.cluster.resolved_workers()),
                num_servers=int(getattr(st, "num_servers", 0)),
                num_stages=int(getattr(st, "num_processes", 0)),  # (pipeline: stages x replicas)
                resume=resume,
                checkpoint=self.checkpoint is not None,
                revocations=self.cluster.revocations.active,
            )
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of the whole configuration (sizes as ints, tuples as lists)."""
        return self.model_dump(mode="json")
