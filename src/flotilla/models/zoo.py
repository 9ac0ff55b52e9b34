"""The model zoo: small ``nn.Sequential`` models built deterministically from a seed.

Invariants:

- every model is an ``nn.Sequential`` of plain layers, so pipeline code can split it into stages
  by layer index;
- initialisation is a pure function of ``(name, input_shape, num_classes, width, seed)``: modules
  are built on the ``meta`` device and initialised from a *local* ``torch.Generator``, so the
  global torch RNG is never read or changed (safe with threads building models concurrently);
- parameters follow PyTorch's default ``Linear``/``Conv`` initialisation
  (``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` for weights and biases).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from flotilla.models.lm import char_transformer

__all__ = ["MODELS", "build_model", "count_parameters"]


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


def _flat_dim(input_shape: Sequence[int]) -> int:
    return math.prod(input_shape)


def _mlp(dims: Sequence[int]) -> list[nn.Module]:
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
        layers.append(nn.Linear(d_in, d_out))
        if i < len(dims) - 2:
            layers.append(nn.ReLU())
    return layers


def _conv_out(length: int, kernel: int, stride: int, padding: int) -> int:
    return (length + 2 * padding - kernel) // stride + 1


def _cnn1d(input_shape: tuple[int, ...], num_classes: int, width: int | None) -> list[nn.Module]:
    """Three 1-D convolutions (two strided) and a two-layer head; ~94 k parameters for MNIST-1D."""
    if len(input_shape) != 2:
        raise ValueError(f"cnn1d needs input_shape (channels, length), got {input_shape}")
    channels, length = input_shape
    w = width or 32
    out_len = _conv_out(_conv_out(_conv_out(length, 5, 1, 2), 3, 2, 0), 3, 2, 0)
    if out_len < 1:
        raise ValueError(f"cnn1d needs an input length >= 7, got {length}")
    return [
        nn.Conv1d(channels, w, kernel_size=5, padding=2),
        nn.ReLU(),
        nn.Conv1d(w, 2 * w, kernel_size=3, stride=2),
        nn.ReLU(),
        nn.Conv1d(2 * w, 2 * w, kernel_size=3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(2 * w * out_len, 4 * w),
        nn.ReLU(),
        nn.Linear(4 * w, num_classes),
    ]


def _mlp_zoo(input_shape: tuple[int, ...], num_classes: int, width: int | None) -> list[nn.Module]:
    """Hidden layers ``[w, w, 3w/4]`` (w = 1024): 2,894,090 parameters for input ``(1024,)``."""
    w = width or 1024
    return _mlp([_flat_dim(input_shape), w, w, max(1, 3 * w // 4), num_classes])


def _tiny_mlp(input_shape: tuple[int, ...], num_classes: int, width: int | None) -> list[nn.Module]:
    """One hidden layer of ``width`` (default 32): for fast tests."""
    return _mlp([_flat_dim(input_shape), width or 32, num_classes])


MODELS: dict[str, Callable[[tuple[int, ...], int, int | None], list[nn.Module]]] = {
    "cnn1d": _cnn1d,
    "mlp": _mlp_zoo,
    "tiny_mlp": _tiny_mlp,
    "char_transformer": char_transformer,
}


def _materialize(model: nn.Module) -> None:
    """Replace meta-device parameters by uninitialised CPU ones (cheaper than ``to_empty``)."""
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                empty = torch.empty(param.shape, dtype=param.dtype, device="cpu")
                module._parameters[key] = nn.Parameter(empty, requires_grad=param.requires_grad)
        if any(b is not None for b in module._buffers.values()):
            raise TypeError(f"no deterministic initialiser for buffers of {type(module).__name__}")


@torch.no_grad()
def _init_parameters(model: nn.Module, generator: torch.Generator) -> None:
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
            fan_in = module.weight[0].numel()
            bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            module.weight.uniform_(-bound, bound, generator=generator)
            if module.bias is not None:
                module.bias.uniform_(-bound, bound, generator=generator)
        elif any(True for _ in module.parameters(recurse=False)):
            raise TypeError(f"no deterministic initialiser for {type(module).__name__}")


def build_model(
    name: str,
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    width: int | None = None,
    seed: int = 0,
) -> nn.Sequential:
    """Build zoo model ``name`` (``cnn1d``, ``mlp``, ``tiny_mlp``) on the CPU, float32.

    ``input_shape`` is one sample's shape (no batch dimension); ``width`` overrides the model's
    base width; the same arguments always give bitwise-equal parameters.
    """
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; allowed: {', '.join(sorted(MODELS))}") from None
    shape = tuple(int(d) for d in input_shape)
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"input_shape must be non-empty positive ints, got {input_shape!r}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if width is not None and width < 1:
        raise ValueError(f"width must be >= 1 or None, got {width}")
    with torch.device("meta"):
        model = nn.Sequential(*factory(shape, int(num_classes), width))
    _materialize(model)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(seed))
    _init_parameters(model, generator)
    return model
