"""Profiler (SPEC §3.1): per-layer forward/backward time, output activation bytes, parameter bytes.

``profile_model(model, sample, loss_fn)`` runs an ``nn.Sequential`` layer by layer on one minibatch
``sample`` (``num_warmup`` untimed runs, then ``num_repeats`` timed ones) and returns a
``ModelProfile`` (``flotilla.pipeline.profile``) whose times are the MEDIAN over the repeats.

Measurement:
- each layer runs on a detached copy of its input (``requires_grad`` for float inputs but the
  model's own: data needs no gradient), so its backward can be timed alone: forward_s(l) = time
  of ``layer(x)``; backward_s(l) = time of ``y_l.backward(grad of y_l)``, which includes the
  gradient with respect to its input (what a stage must send upstream) and its parameter
  gradients;
- the loss is part of the last layer: its forward includes ``loss_fn(output)``, its backward
  starts from the loss;
- ``activation_bytes`` = bytes of the layer's output for the minibatch; ``param_bytes`` = bytes of
  its parameters; ``input_bytes`` = bytes of ``sample``;
- what the layer holds for its backward, through autograd's saved-tensor hooks around its
  forward (the last layer's with the loss): ``saved_bytes``, every saved storage once but its
  parameters', its input's and its output's, and whether it saves its input (``keeps_input``) or
  its output (``keeps_output``), and whether its output is a view of its input (``aliases_input``:
  a flatten or reshape holds no memory of its own) -- what ``ModelProfile.held_bytes`` adds up for
  a stage, and what the stage runtime measures the same way at run time (``instrument.SavedBytes``).
  Measured in fp32: a job in bf16 holds other amounts (bf16 copies of inputs and weights); each
  stage's own measurement, in the job's precision, shows the real figure against its budget;
- the model is left as it was: its mode, and every buffer (BatchNorm's running statistics) restored;
- the clock is injectable (default ``time.perf_counter``) and the profiled device is treated as a
  device of speed 1.0.

Layer names are ``"<index>:<class name>"`` (unique).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flotilla.core.errors import ConfigError
from flotilla.pipeline.profile import LayerProfile, ModelProfile
from flotilla.pipeline.trace import LABEL_ATTR

__all__ = ["layer_names", "profile_model", "tensor_bytes"]


def tensor_bytes(tensor: Any) -> int:
    """Bytes of a tensor, or of the tensors in a tuple/list/dict (a last layer's structured output)."""
    if isinstance(tensor, torch.Tensor):
        return int(tensor.numel() * tensor.element_size())
    if isinstance(tensor, dict):
        return sum(tensor_bytes(v) for v in tensor.values())
    if isinstance(tensor, (tuple, list)):
        return sum(tensor_bytes(v) for v in tensor)
    return 0


def layer_names(model: nn.Sequential) -> list[str]:
    """``index:name``: a traced layer's label (the module it starts with), else its class."""
    return [f"{idx}:{getattr(layer, LABEL_ATTR, type(layer).__name__)}" for idx, layer in enumerate(model)]


@dataclass(frozen=True, slots=True)
class _Held:
    saved_bytes: int
    keeps_input: bool
    keeps_output: bool
    aliases_input: bool


def _storages(value: Any) -> set[int]:
    if isinstance(value, torch.Tensor):
        return {value.untyped_storage().data_ptr()}
    if isinstance(value, dict):
        return set().union(*(_storages(v) for v in value.values())) if value else set()
    if isinstance(value, (tuple, list)):
        return set().union(*(_storages(v) for v in value)) if value else set()
    return set()


def _held(saved: dict[int, int], layer: nn.Module, xin: torch.Tensor, y: Any) -> _Held:
    """What ``layer``'s forward saved (``saved``: storage address -> bytes), split as the profile
    records it (module doc)."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    ins, outs = _storages(xin), _storages(y)
    own = sum(n for ptr, n in saved.items() if ptr not in params | ins | outs)
    return _Held(own, bool(ins & saved.keys()), bool(outs & saved.keys()), bool(ins & outs))


def _one_run(
    model: nn.Sequential,
    sample: torch.Tensor,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    clock: Callable[[], float],
) -> tuple[list[float], list[float], list[int], list[_Held]]:
    """Forward and backward seconds, output bytes and what is held, per layer, for one minibatch."""
    inputs, outputs, fwd, out_bytes, held = [], [], [], [], []
    x = sample
    for idx, layer in enumerate(model):
        # (the model's input is data: no gradient for it, as in stage 0; a later layer's input
        # needs one, which is what a stage sends upstream)
        xin = x.detach().requires_grad_(idx > 0 and x.is_floating_point())
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
            return t.detach()  # (not ``t``: a saved output would hold its own graph, SavedBytes.pack)

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            start = clock()
            y = layer(xin)
            if idx == len(model) - 1:
                out_bytes.append(tensor_bytes(y))
                y = loss_fn(y)
            fwd.append(clock() - start)
        if idx < len(model) - 1:
            out_bytes.append(tensor_bytes(y))
        held.append(_held(saved, layer, xin, y))
        inputs.append(xin)
        outputs.append(y)
        x = y
    bwd = [0.0] * len(model)
    grad: torch.Tensor | None = None
    for idx in range(len(model) - 1, -1, -1):
        start = clock()
        if outputs[idx].requires_grad:
            outputs[idx].backward(grad)
        bwd[idx] = clock() - start
        grad = inputs[idx].grad
    return fwd, bwd, out_bytes, held


def profile_model(
    model: nn.Sequential,
    sample: torch.Tensor,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    num_warmup: int = 1,
    num_repeats: int = 3,
    device_name: str = "cpu",
    clock: Callable[[], float] = time.perf_counter,
) -> ModelProfile:
    """Profile ``model`` on the minibatch ``sample``; ``loss_fn(output) -> scalar`` closes the model."""
    if not isinstance(model, nn.Sequential) or len(model) == 0:
        raise ConfigError("profile_model needs a non-empty nn.Sequential")
    if num_warmup < 0 or num_repeats < 1:
        raise ConfigError(f"need num_warmup >= 0 and num_repeats >= 1, got {num_warmup}, {num_repeats}")
    was_training = model.training
    saved = [(b, b.detach().clone()) for b in model.buffers()]  # (restored: BatchNorm statistics)
    model.train()
    runs = []
    try:
        for rep in range(num_warmup + num_repeats):
            result = _one_run(model, sample, loss_fn, clock)
            if rep >= num_warmup:
                runs.append(result)
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)
    names = layer_names(model)
    layers = tuple(
        LayerProfile(
            name=names[idx],
            forward_s=statistics.median(run[0][idx] for run in runs),
            backward_s=statistics.median(run[1][idx] for run in runs),
            activation_bytes=runs[0][2][idx],
            param_bytes=sum(tensor_bytes(p) for p in layer.parameters()),
            saved_bytes=runs[0][3][idx].saved_bytes,
            keeps_input=runs[0][3][idx].keeps_input,
            keeps_output=runs[0][3][idx].keeps_output,
            aliases_input=runs[0][3][idx].aliases_input,
        )
        for idx, layer in enumerate(model)
    )
    return ModelProfile(
        layers=layers,
        batch_size=int(sample.shape[0]),
        input_bytes=tensor_bytes(sample),
        device_name=device_name,
    )
