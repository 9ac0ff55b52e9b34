"""Per-layer profile of a model (SPEC §3.1): pure data, JSON in and out, no torch.

A ``ModelProfile`` is what the profiler measures on one device and what the partitioner, the
planner and the simulator read.  Invariants (checked on construction):

- ``layers`` is a non-empty tuple of ``LayerProfile`` in model order, with unique names;
- every time is a finite number >= 0 (seconds for ONE minibatch of ``batch_size`` samples on the
  profiling device, i.e. a device of speed 1.0); every size is an int >= 0 (bytes);
- ``activation_bytes`` of layer l is the size of l's OUTPUT for one minibatch (what crosses a stage
  boundary after l, forward as activations and backward as gradients); ``input_bytes`` is the size
  of the model's input for one minibatch;
- what a layer HOLDS for its backward (measured by the profiler through autograd's saved-tensor
  hooks, optional): ``saved_bytes``, the tensors its forward saves other than its parameters, its
  input and its output (each storage once), and whether it saves its input (``keeps_input``) and
  its output (``keeps_output``), and whether its output is a view of its input
  (``aliases_input``); the last layer's includes the loss's.  A profile without them
  (older files, synthetic profiles) plans with the outputs alone (``pipeline/plan.CostModel``).

Files are written atomically (``atomic_write_json``) and validated on load: every error names the
file, the field and the allowed values.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flotilla.core.atomic_io import atomic_write_json
from flotilla.core.errors import ConfigError

PROFILE_FORMAT_VERSION = 1

_LAYER_KEYS = ("name", "forward_s", "backward_s", "activation_bytes", "param_bytes")
# (optional: what the layer holds for its backward)
_HELD_KEYS = ("saved_bytes", "keeps_input", "keeps_output", "aliases_input")


def _check_seconds(field: str, value: object) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:  # type: ignore[arg-type, operator]
        raise ConfigError(f"{field} must be a finite number of seconds >= 0, got {value!r}")


def _check_bytes(field: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{field} must be an integer number of bytes >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerProfile:
    """Measured costs of one layer for one minibatch on a speed-1.0 device."""

    name: str
    forward_s: float
    backward_s: float
    activation_bytes: int
    param_bytes: int
    saved_bytes: int | None = None
    keeps_input: bool = True
    keeps_output: bool = False
    aliases_input: bool = False  # (its output is a view of its input: no memory of its own)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"LayerProfile.name must be a non-empty string, got {self.name!r}")
        _check_seconds(f"layer {self.name!r}: forward_s", self.forward_s)
        _check_seconds(f"layer {self.name!r}: backward_s", self.backward_s)
        _check_bytes(f"layer {self.name!r}: activation_bytes", self.activation_bytes)
        _check_bytes(f"layer {self.name!r}: param_bytes", self.param_bytes)
        if self.saved_bytes is not None:
            _check_bytes(f"layer {self.name!r}: saved_bytes", self.saved_bytes)
        for flag in ("keeps_input", "keeps_output", "aliases_input"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(
                    f"layer {self.name!r}: {flag} must be true or false, got {getattr(self, flag)!r}"
                )

    @property
    def compute_s(self) -> float:
        """Forward plus backward time."""
        return self.forward_s + self.backward_s

    def to_dict(self) -> dict[str, Any]:
        keys = _LAYER_KEYS + (_HELD_KEYS if self.saved_bytes is not None else ())
        return {key: getattr(self, key) for key in keys}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "layer") -> LayerProfile:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where} must be an object with keys {list(_LAYER_KEYS)}")
        _check_keys(where, data, required=_LAYER_KEYS, optional=_HELD_KEYS)
        return cls(**{key: data[key] for key in _LAYER_KEYS + _HELD_KEYS if key in data})


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelProfile:
    """An ordered list of layer profiles measured at ``batch_size`` samples per minibatch."""

    layers: tuple[LayerProfile, ...]
    batch_size: int
    input_bytes: int = 0
    device_name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.layers, tuple) or not self.layers:
            raise ConfigError("ModelProfile.layers must be a non-empty tuple of LayerProfile")
        for idx, layer in enumerate(self.layers):
            if not isinstance(layer, LayerProfile):
                raise ConfigError(f"ModelProfile.layers[{idx}] must be a LayerProfile")
        names = [layer.name for layer in self.layers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"ModelProfile.layers: layer names must be unique, repeated: {dupes}")
        if not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool) or self.batch_size < 1:
            raise ConfigError(f"ModelProfile.batch_size must be an integer >= 1, got {self.batch_size!r}")
        _check_bytes("ModelProfile.input_bytes", self.input_bytes)
        if not isinstance(self.device_name, str):
            raise ConfigError(f"ModelProfile.device_name must be a string, got {self.device_name!r}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def total_compute_s(self) -> float:
        """Forward plus backward time of the whole model for one minibatch."""
        return math.fsum(layer.compute_s for layer in self.layers)

    @property
    def total_param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    def held_bytes(self, j: int, k: int) -> int:
        """Bytes a stage of layers [j, k) holds from a minibatch's forward until its backward:
        its input (kept by every stage but a first one whose first layer saves nothing of it),
        what each layer saves, an inner layer's output when it or the next layer saves it, and the
        stage's output (sent on, kept for the backward; not the last stage's loss).  Without the
        measured fields: the stage's input and every layer's output."""
        layers = self.layers[j:k]
        stage_input = self.layers[j - 1].activation_bytes if j > 0 else self.input_bytes
        if any(layer.saved_bytes is None for layer in layers):
            return stage_input + sum(layer.activation_bytes for layer in layers)
        counted = j > 0 or layers[0].keeps_input  # (whether the current layer's input is counted)
        held = stage_input if counted else 0
        for i, layer in enumerate(layers):
            held += layer.saved_bytes or 0
            last = i == len(layers) - 1
            kept = (not last and (layer.keeps_output or layers[i + 1].keeps_input)) or (
                last and k < self.num_layers
            )
            if layer.aliases_input and counted:
                continue  # (a view of a counted input: the same storage)
            if kept:
                held += layer.activation_bytes
            counted = kept
        return held

    @classmethod
    def uniform(
        cls,
        num_layers: int,
        *,
        forward_s: float = 1.0,
        backward_s: float = 2.0,
        activation_bytes: int = 0,
        param_bytes: int = 0,
        batch_size: int = 1,
    ) -> ModelProfile:
        """A synthetic profile of ``num_layers`` identical layers named ``layer0`` ... (tests, sim)."""
        layers = tuple(
            LayerProfile(
                name=f"layer{i}",
                forward_s=forward_s,
                backward_s=backward_s,
                activation_bytes=activation_bytes,
                param_bytes=param_bytes,
            )
            for i in range(num_layers)
        )
        return cls(layers=layers, batch_size=batch_size)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": PROFILE_FORMAT_VERSION,
            "batch_size": self.batch_size,
            "input_bytes": self.input_bytes,
            "device_name": self.device_name,
            "layers": [layer.to_dict() for layer in self.layers],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelProfile:
        """Inverse of ``to_dict``; raises ``ConfigError`` naming the offending field."""
        if not isinstance(data, Mapping):
            raise ConfigError("profile must be a JSON object")
        _check_keys(
            "profile",
            data,
            required=("format_version", "batch_size", "layers"),
            optional=("input_bytes", "device_name"),
        )
        if data["format_version"] != PROFILE_FORMAT_VERSION:
            raise ConfigError(
                f"profile.format_version must be {PROFILE_FORMAT_VERSION}, got {data['format_version']!r}"
            )
        raw_layers = data["layers"]
        if not isinstance(raw_layers, list):
            raise ConfigError("profile.layers must be a list of layer objects")
        layers = tuple(
            LayerProfile.from_dict(item, f"profile.layers[{i}]") for i, item in enumerate(raw_layers)
        )
        return cls(
            layers=layers,
            batch_size=data["batch_size"],
            input_bytes=data.get("input_bytes", 0),
            device_name=data.get("device_name", ""),
        )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the profile as JSON atomically; returns the path."""
        atomic_write_json(path, self.to_dict())
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ModelProfile:
        """Read and validate a profile file; every failure is a ``ConfigError`` naming the file."""
        target = Path(path)
        try:
            text = target.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read profile file {target}: {exc.strerror or exc}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"profile file {target} is not valid JSON: {exc}") from exc
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"profile file {target}: {exc}") from exc


def save_profile(profile: ModelProfile, path: str | os.PathLike[str]) -> Path:
    """Module-level alias of ``ModelProfile.save``."""
    return profile.save(path)


def load_profile(path: str | os.PathLike[str]) -> ModelProfile:
    """Module-level alias of ``ModelProfile.load``."""
    return ModelProfile.load(path)


def _check_keys(
    where: str, data: Mapping[str, Any], *, required: tuple[str, ...], optional: tuple[str, ...]
) -> None:
    missing = [key for key in required if key not in data]
    if missing:
        raise ConfigError(f"{where} is missing required field(s) {missing}")
    unknown = sorted(str(key) for key in data if key not in required and key not in optional)
    if unknown:
        raise ConfigError(f"{where} has unknown field(s) {unknown}; allowed: {sorted(required + optional)}")


def scaled_profile(profile: ModelProfile, share: int) -> ModelProfile:
    """``profile`` for minibatches of ``share`` samples: times and activations scale with it
    (parameters do not) -- the one model of a profile at another share, for the simulator and for
    a VW formed again at run time, so every share compared comes from one measurement."""
    f = share / profile.batch_size
    layers = tuple(
        replace(
            layer,
            forward_s=layer.forward_s * f,
            backward_s=layer.backward_s * f,
            activation_bytes=int(layer.activation_bytes * f),
            saved_bytes=None if layer.saved_bytes is None else int(layer.saved_bytes * f),
        )
        for layer in profile.layers
    )
    return replace(profile, layers=layers, batch_size=share, input_bytes=int(profile.input_bytes * f))
