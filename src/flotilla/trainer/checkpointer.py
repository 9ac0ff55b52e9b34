"""The one checkpoint writer and reader of training state, for replicas and pipeline stages alike.

A checkpoint holds a model -- the whole model of a replica, or a stage's layers -- with its
optimizer, in one layout (``elastic/checkpoint.py``: safetensors + manifest, atomic, verified,
keep N)::

    model.safetensors      the module's state_dict, by its own keys
    optim.safetensors      the optimizer's per-parameter tensors (``t<i>``: sync/state.export_state)
    strategy.safetensors   the strategy's own state (SyncStrategy.state_dict), if it has any
    rng.safetensors        torch's RNG state, when the writer keeps it (a stage: its dropout masks)
    manifest.json          meta: ``state`` (keys, optimizer slots), ``step``, ``config`` (the settings
                           the fingerprint covers), the writer's own fields; the LR schedule's state

Who writes where and when is the caller's: rank 0 of the replicas writes the committed state into
``checkpoint.dir`` (``roles/worker_files.py``); the lead instance of each pipeline stage writes its
part into ``checkpoint.dir/stage<i>`` with its place in the split (``trainer/pipeline_checkpoint.py``
reads a step every stage wrote).  The loop's boundary rule says at which steps
(``trainer/boundary.py``).

**In the background** (``background=True``: the replicas' writer): ``write`` copies the state to
host memory (the training goes on changing the live tensors) and returns; a thread serialises,
hashes, writes, fsyncs and renames it, so training does not wait for the disk (on a GPU a
checkpoint of an 8-layer transformer with AdamW held the step for ~2 s).  One write at a time: the
next ``write`` first waits for the one in flight; ``flush`` waits for it and raises what it
failed with (the next ``write`` does too), so a failed write stops the job one checkpoint later,
as a synchronous one would have at once.  A process killed meanwhile leaves the previous
checkpoint (the new one never got its final name: ``elastic/checkpoint.py``).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flotilla.core.log import get_logger
from flotilla.elastic.checkpoint import Checkpoint, CheckpointError, write_checkpoint
from flotilla.sync.state import export_state, import_state

__all__ = ["CheckpointPlan", "Checkpointer", "load_into"]

log = get_logger("checkpoint")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointPlan:
    """Where a writer's checkpoints go and how many it keeps; ``fingerprint``: the run config's
    (``RunConfig.fingerprint``), checked on resume; ``settings``: what it covers, recorded so that a
    resume with other settings can name them."""

    directory: Path
    keep: int
    fingerprint: str
    settings: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise CheckpointError(f"checkpoint keep must be >= 1, got {self.keep}")


class Checkpointer:
    """Writes the state of ``model``/``optimizer`` after ``step`` committed steps (module doc).

    ``meta``: the writer's own manifest fields for a step (a stage: its index, split and losses so
    far); ``rng``: keep torch's RNG state too."""

    def __init__(
        self,
        plan: CheckpointPlan | None,
        *,
        meta: Callable[[int], Mapping[str, Any]] | None = None,
        rng: bool = False,
        background: bool = False,
    ) -> None:
        self.plan, self._meta, self._rng, self._background = plan, meta, rng, background
        self._pending: threading.Thread | None = None
        self._failed: BaseException | None = None

    @property
    def enabled(self) -> bool:
        return self.plan is not None

    @property
    def directory(self) -> Path | None:
        return self.plan.directory if self.plan is not None else None

    @property
    def keep(self) -> int:
        return self.plan.keep if self.plan is not None else 1

    def write(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: Mapping[str, Any] | None = None,
        strategy: Mapping[str, torch.Tensor] | None = None,
    ) -> Path:
        """``scheduler``: the LR schedule's state (``optim.scheduler_state``); ``strategy``: the
        strategy's own state.  The checkpoint's path (in the background: where it will be)."""
        plan = self.plan
        if plan is None:
            raise CheckpointError("checkpoint written without a checkpoint plan (no checkpoint.dir)")
        self.flush()  # (one write at a time; raises what the last one in the background failed with)
        state, tensors = export_state(model, optimizer, {"step": step})
        num_model = len(state["model_keys"])
        parts: dict[str, dict[str, torch.Tensor]] = {
            "model": dict(model.state_dict()),
            "optim": {f"t{i}": t for i, t in enumerate(tensors[num_model:], start=num_model)},
        }
        if strategy:
            parts["strategy"] = {k: v.detach() for k, v in strategy.items()}
        if self._rng:
            parts["rng"] = {"torch": torch.get_rng_state()}
        meta: dict[str, Any] = {"state": state, "step": step}
        if plan.settings is not None:
            meta["config"] = dict(plan.settings)
        if self._meta is not None:
            meta.update(self._meta(step))
        if not self._background:
            path = self._write_now(plan, step, parts, meta, scheduler)
            log.info("checkpoint of step %d written to %s", step, path)
            return path
        t0 = time.perf_counter()
        parts = {name: {k: _host_copy(t) for k, t in ts.items()} for name, ts in parts.items()}
        args = (plan, step, parts, copy.deepcopy(meta), copy.deepcopy(scheduler), time.perf_counter() - t0)
        self._pending = threading.Thread(
            target=self._write_in_background, args=args, name=f"checkpoint-{step}", daemon=True
        )
        self._pending.start()
        return plan.directory / f"ckpt-{step:09d}"

    def flush(self) -> None:
        """Wait for the write in the background (if any); raise what it failed with."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.join()
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    @staticmethod
    def _write_now(
        plan: CheckpointPlan,
        step: int,
        parts: Mapping[str, Mapping[str, torch.Tensor]],
        meta: Mapping[str, Any],
        scheduler: Mapping[str, Any] | None,
    ) -> Path:
        return write_checkpoint(
            plan.directory,
            step=step,
            parts=parts,
            meta=meta,
            fingerprint=plan.fingerprint,
            keep=plan.keep,
            scheduler=scheduler,
        )

    def _write_in_background(
        self,
        plan: CheckpointPlan,
        step: int,
        parts: Mapping[str, Mapping[str, torch.Tensor]],
        meta: Mapping[str, Any],
        scheduler: Mapping[str, Any] | None,
        copy_s: float,
    ) -> None:
        t0 = time.perf_counter()
        try:
            path = self._write_now(plan, step, parts, meta, scheduler)
        except BaseException as exc:  # (raised in the training thread at the next write or flush)
            log.error("checkpoint of step %d failed in the background: %s", step, exc)
            self._failed = exc
            return
        log.info(
            "checkpoint of step %d written to %s (training held %.3f s for the copy; written in "
            "the background in %.2f s)",
            step,
            path,
            copy_s,
            time.perf_counter() - t0,
        )


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory that training no longer changes."""
    return t.detach().to("cpu", copy=True)


def load_into(ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load a checkpoint :class:`Checkpointer` wrote into ``model``/``optimizer`` (and torch's RNG,
    if it kept it); returns its step.  CheckpointError (one line) when it does not fit the model."""
    meta = ckpt.meta.get("state")
    if "model" not in ckpt.parts and "state" in ckpt.parts:
        raise CheckpointError(
            f"checkpoint {ckpt.path}: written in the stage layout before the one checkpointer "
            "(parts 'state', 'rng'); this version cannot load it: start a new checkpoint.dir"
        )
    if not isinstance(meta, dict) or "model" not in ckpt.parts:
        raise CheckpointError(f"checkpoint {ckpt.path}: holds no model state")
    try:
        keys = list(meta["model_keys"])
        tensors = [ckpt.parts["model"][k] for k in keys]
        optim = ckpt.parts.get("optim", {})
        tensors += [optim[f"t{i}"] for i in range(len(keys), len(keys) + len(optim))]
        step = int(import_state(model, optimizer, meta, tensors)["step"])
        if "rng" in ckpt.parts:
            torch.set_rng_state(ckpt.parts["rng"]["torch"])
    except (KeyError, ValueError, TypeError, IndexError, AttributeError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint {ckpt.path}: does not fit this model ({exc})") from exc
    return step
