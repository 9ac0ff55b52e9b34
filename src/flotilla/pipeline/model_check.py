"""What a pipeline refuses about a model, found before any process starts, each in one line naming
the layer (or parameter) and the reason (``docs/tasks.md`` lists them); and how to run a model
for a probe without disturbing it.

- :func:`probing`: eval mode, no gradients, and every buffer restored afterwards (BatchNorm's
  running statistics, a model's own counters): a probe (the boundary shapes, the checks below)
  leaves the model exactly as it found it.
- :func:`check_layers`: the model's input must be one tensor (stage 0 receives the data, each
  stage one tensor from the stage before), and every layer but the last must return one tensor
  with the batch dimension first (the partitioner may cut after any layer); the last layer may
  return anything the task's loss takes (a tuple of logits and an auxiliary value).  Integer
  tensors may cross (no gradient flows back through them).
- :func:`split_ties`: a parameter shared by layers that the split puts in different stages (a
  language model's output layer tied to its embedding) lives as one copy per stage; the stages
  holding it sum its gradient at every flush (``trainer/stage_engine.py``, DeepSpeed's tied
  layers) and apply the same update, so the copies stay bitwise equal.  The asynchronous
  ``pipedream`` schedule has no flush to do it at: :func:`refuse_split_ties` refuses it there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flotilla.core.errors import ConfigError
from flotilla.pipeline.trace import LABEL_ATTR

__all__ = ["SplitTie", "check_layers", "probing", "refuse_split_ties", "split_ties", "tied_parameters"]


@dataclass(frozen=True, slots=True)
class SplitTie:
    """A parameter used by layers of several stages: its first name, the stages holding it (in
    order) and the parameter itself (every stage process builds the whole model)."""

    name: str
    stages: tuple[int, ...]
    param: nn.Parameter


@contextmanager
def probing(model: nn.Module) -> Iterator[None]:
    """Run ``model`` in eval mode without gradients; restore its mode and every buffer after."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def _layer(model: nn.Sequential, idx: int) -> str:
    return f"layer {idx} ({getattr(model[idx], LABEL_ATTR, type(model[idx]).__name__)})"


def _kind(value: Any) -> str:
    return type(value).__name__


def check_layers(model: nn.Sequential, sample: Any) -> None:
    """One line (ConfigError) for what a pipeline cannot cut (module doc); ``sample``: a few
    training inputs (two or more samples, so the batch dimension can be told apart)."""
    if not isinstance(sample, torch.Tensor):
        raise ConfigError(
            f"pipeline strategies need one tensor as the model's input; the task's inputs are a "
            f"{_kind(sample)} (train it with allreduce or ps, or make layer 0 take one tensor)"
        )
    n = int(sample.shape[0])
    x: Any = sample
    with probing(model):
        for idx, layer in enumerate(model):
            try:
                x = layer(x)
            except Exception as exc:
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise ConfigError(
                    f"pipeline: {_layer(model, idx)} failed on a probe batch: {first}"
                ) from None
            if idx == len(model) - 1:
                return
            if not isinstance(x, torch.Tensor):
                raise ConfigError(
                    f"pipeline: {_layer(model, idx)} returns a {_kind(x)}; every layer but the last "
                    "must return one tensor (only the last may return a tuple for the loss)"
                )
            if x.dim() < 1 or int(x.shape[0]) != n:
                raise ConfigError(
                    f"pipeline: {_layer(model, idx)} returns shape {tuple(x.shape)} for {n} samples; "
                    "every layer but the last must keep the batch dimension first"
                )


def tied_parameters(model: nn.Sequential) -> list[tuple[str, int, str, int]]:
    """``(name, layer, other_name, other_layer)`` for each parameter that a later layer shares
    with an earlier one (the same tensor storage)."""
    first: dict[int, tuple[str, int]] = {}
    ties = []
    for idx, layer in enumerate(model):
        for name, p in layer.named_parameters(remove_duplicate=False):
            key = p.untyped_storage().data_ptr() if p.numel() else id(p)
            full = f"{idx}.{name}"
            if key in first and first[key][1] != idx:
                ties.append((full, idx, *first[key]))
            else:
                first.setdefault(key, (full, idx))
    return ties


def _stage_of(layer_ends: Sequence[int], layer: int) -> int:
    return next(s for s, end in enumerate(layer_ends) if layer < end)


def split_ties(model: nn.Sequential, layer_ends: Sequence[int]) -> list[SplitTie]:
    """The tied parameters the split ``layer_ends`` puts in more than one stage, in the model's
    order (the same list in every stage process)."""
    groups: dict[str, tuple[nn.Parameter, set[int]]] = {}
    params = {f"{i}.{n}": p for i, layer in enumerate(model) for n, p in layer.named_parameters()}
    for _, idx, other, other_idx in tied_parameters(model):
        _, stages = groups.setdefault(other, (params[other], set()))
        stages.update({_stage_of(layer_ends, other_idx), _stage_of(layer_ends, idx)})
    return [SplitTie(name, tuple(sorted(s)), p) for name, (p, s) in groups.items() if len(s) > 1]


def refuse_split_ties(
    model: nn.Sequential, layer_ends: Sequence[int], schedule: str, *, fix: str = "use schedule gpipe or 1f1b"
) -> None:
    """ConfigError (one line, ending with ``fix``: what the user can do) if the split
    ``layer_ends`` puts tied parameters in two stages of a schedule without flushes (``pipedream``)."""
    for tie in split_ties(model, layer_ends):
        raise ConfigError(
            f"pipeline: parameter {tie.name} is tied across stages {', '.join(map(str, tie.stages))} "
            f"(the same tensor in layers of each), which the {schedule} schedule cannot keep tied (no "
            f"flush at which the stages could sum its gradient); {fix}"
        )
