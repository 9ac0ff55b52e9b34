"""One cluster description: devices and the links between them (pure; SPEC §8, §3.2, §9).

A ``ClusterSpec`` is what the run configuration's ``cluster`` section produces
(``ClusterConfig.spec()``), what the pipeline partitioner plans over, and what HetPipe placement
and the simulator will read.  It is plain data, loadable from a mapping or a YAML string
(``ClusterSpec.from_mapping`` / ``from_yaml_text``; opening files is the caller's business):

```yaml
devices:
  - {name: gpu0, type: V100, node: n0, speed: 1.0, memory_bytes: 17179869184}
  - {name: gpu1, type: K80, node: n1, speed: 0.25, memory_bytes: 12884901888}
links:
  bandwidth_gbps: 10.0        # default for every pair
  latency_s: 0.0
  pairs:
    - {a: gpu0, b: gpu1, bandwidth_gbps: 1.0, latency_s: 0.001}
```

Invariants (checked on construction, ``ConfigError`` naming the field and the allowed values):
- device names are non-empty and unique; ``speed`` > 0 is relative to the reference device
  (time = reference time / speed; the configuration requires 0 < speed <= 1, i.e. relative to the
  fastest device); ``memory_bytes`` is an integer > 0;
- links are symmetric: ``link(a, b) == link(b, a)``; a pair listed twice is refused; pairs name
  known devices (checked by ``ClusterSpec``);
- bandwidths are gigabits per second (1e9 bit/s), latencies seconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flotilla.core.errors import ConfigError

__all__ = [
    "DEFAULT_BANDWIDTH_GBPS",
    "ClusterSpec",
    "DeviceSpec",
    "Link",
    "LinkModel",
    "PairLink",
]

DEFAULT_BANDWIDTH_GBPS = 10.0
DEFAULT_DEVICE_TYPE = "cpu"
DEFAULT_NODE = "local"


def _number(owner: str, name: str, value: object, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):  # type: ignore[operator]
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{owner}.{name} must be a finite number {bound}, got {value!r}")


def _name(owner: str, name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{owner}.{name} must be a non-empty string, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    """One device: ``speed`` relative to the reference device (time = reference time / speed),
    ``type`` a free label ("cpu", "cuda", "V100", ...), ``node`` the machine it sits in."""

    name: str
    type: str = DEFAULT_DEVICE_TYPE
    node: str = DEFAULT_NODE
    speed: float = 1.0
    memory_bytes: int

    def __post_init__(self) -> None:
        _name("DeviceSpec", "name", self.name)
        _name("DeviceSpec", "type", self.type)
        _name("DeviceSpec", "node", self.node)
        _number("DeviceSpec", "speed", self.speed)
        if (
            not isinstance(self.memory_bytes, int)
            or isinstance(self.memory_bytes, bool)
            or self.memory_bytes <= 0
        ):
            raise ConfigError(f"DeviceSpec.memory_bytes must be an integer > 0, got {self.memory_bytes!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """The resolved link between two devices (what ``LinkModel.link`` returns)."""

    bandwidth_gbps: float
    latency_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class PairLink:
    """Bandwidth (and optionally latency) of the link between devices ``a`` and ``b`` (symmetric)."""

    a: str
    b: str
    bandwidth_gbps: float
    latency_s: float | None = None

    def __post_init__(self) -> None:
        _name("PairLink", "a", self.a)
        _name("PairLink", "b", self.b)
        if self.a == self.b:
            raise ConfigError(f"PairLink needs two different devices, got {self.a!r} twice")
        _number("PairLink", "bandwidth_gbps", self.bandwidth_gbps)
        if self.latency_s is not None:
            _number("PairLink", "latency_s", self.latency_s, allow_zero=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkModel:
    """Latency-bandwidth model: ``pairs`` override the defaults for specific device pairs.
    Bandwidths are in gigabits per second (1e9 bit/s)."""

    default_bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS
    latency_s: float = 0.0
    pairs: tuple[PairLink, ...] = ()
    _lookup: dict[frozenset[str], PairLink] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        _number("LinkModel", "default_bandwidth_gbps", self.default_bandwidth_gbps)
        _number("LinkModel", "latency_s", self.latency_s, allow_zero=True)
        if not isinstance(self.pairs, tuple) or not all(isinstance(p, PairLink) for p in self.pairs):
            raise ConfigError(f"LinkModel.pairs must be a tuple of PairLink, got {self.pairs!r}")
        for pair in self.pairs:
            key = frozenset((pair.a, pair.b))
            if key in self._lookup:
                raise ConfigError(f"LinkModel.pairs lists the link {pair.a}-{pair.b} twice")
            self._lookup[key] = pair

    def bandwidth_gbps(self, a: str, b: str) -> float:
        pair = self._lookup.get(frozenset((a, b)))
        return pair.bandwidth_gbps if pair else self.default_bandwidth_gbps

    def link_latency_s(self, a: str, b: str) -> float:
        pair = self._lookup.get(frozenset((a, b)))
        return pair.latency_s if pair and pair.latency_s is not None else self.latency_s

    def link(self, a: str, b: str) -> Link:
        """The link between ``a`` and ``b`` (either order)."""
        return Link(bandwidth_gbps=self.bandwidth_gbps(a, b), latency_s=self.link_latency_s(a, b))

    def names(self) -> set[str]:
        """Every device name some pair mentions."""
        return {name for pair in self.pairs for name in (pair.a, pair.b)}

    def among(self, names: set[str]) -> LinkModel:
        """The same model restricted to the pairs between ``names`` (a subset of the devices)."""
        pairs = tuple(pair for pair in self.pairs if pair.a in names and pair.b in names)
        return LinkModel(
            default_bandwidth_gbps=self.default_bandwidth_gbps, latency_s=self.latency_s, pairs=pairs
        )

    def to_mapping(self) -> dict[str, Any]:
        """The YAML/JSON form read back by :meth:`ClusterSpec.from_mapping` (``links`` key)."""
        pairs = [
            {"a": p.a, "b": p.b, "bandwidth_gbps": p.bandwidth_gbps}
            | ({} if p.latency_s is None else {"latency_s": p.latency_s})
            for p in self.pairs
        ]
        return {"bandwidth_gbps": self.default_bandwidth_gbps, "latency_s": self.latency_s, "pairs": pairs}


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """The devices of a cluster and the links between them (see the module docstring)."""

    devices: tuple[DeviceSpec, ...]
    links: LinkModel = LinkModel()
    _by_name: dict[str, DeviceSpec] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.devices, tuple) or not all(isinstance(d, DeviceSpec) for d in self.devices):
            raise ConfigError(f"ClusterSpec.devices must be a tuple of DeviceSpec, got {self.devices!r}")
        if not self.devices:
            raise ConfigError("ClusterSpec.devices must name at least one device")
        names = [d.name for d in self.devices]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"ClusterSpec.devices: device names must be unique, repeated {duplicates}")
        if not isinstance(self.links, LinkModel):
            raise ConfigError(f"ClusterSpec.links must be a LinkModel, got {self.links!r}")
        unknown = sorted(self.links.names() - set(names))
        if unknown:
            raise ConfigError(f"LinkModel.pairs name unknown device(s) {unknown}; devices are {names}")
        self._by_name.update((d.name, d) for d in self.devices)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.devices)

    @property
    def nodes(self) -> tuple[str, ...]:
        """Node names in order of first appearance."""
        return tuple(dict.fromkeys(d.node for d in self.devices))

    def device(self, name: str) -> DeviceSpec:
        """The device called ``name``; ``ConfigError`` listing the known names otherwise."""
        try:
            return self._by_name[name]
        except KeyError:
            raise ConfigError(f"unknown device {name!r}; devices are {list(self.names)}") from None

    def link(self, a: str, b: str) -> Link:
        """The (symmetric) link between two known devices."""
        self.device(a), self.device(b)
        return self.links.link(a, b)

    def devices_of_node(self, node: str) -> tuple[DeviceSpec, ...]:
        """The devices on ``node`` in declaration order (empty for an unknown node)."""
        return tuple(d for d in self.devices if d.node == node)

    # ------------------------------------------------------------------ data form
    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ClusterSpec:
        """Build from ``{"devices": [...], "links": {...}}`` (the YAML form of the module docstring);
        unknown keys are refused with the allowed ones named."""
        _keys("cluster spec", data, {"devices", "links"})
        raw_devices = data.get("devices")
        if not isinstance(raw_devices, (list, tuple)):
            raise ConfigError(f"cluster spec: devices must be a list of mappings, got {raw_devices!r}")
        devices = tuple(_device_from(entry, i) for i, entry in enumerate(raw_devices))
        return cls(devices=devices, links=_links_from(data.get("links") or {}))

    @classmethod
    def from_yaml_text(cls, text: str) -> ClusterSpec:
        """Parse a YAML document (a string; reading the file is the caller's job)."""
        import yaml  # local: only this constructor needs it

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"cluster spec: not valid YAML: {exc}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"cluster spec: expected a mapping with devices/links, got {type(data).__name__}"
            )
        return cls.from_mapping(data)

    def to_mapping(self) -> dict[str, Any]:
        """The data form (JSON/YAML-able) that :meth:`from_mapping` reads back."""
        devices = [
            {"name": d.name, "type": d.type, "node": d.node, "speed": d.speed, "memory_bytes": d.memory_bytes}
            for d in self.devices
        ]
        return {"devices": devices, "links": self.links.to_mapping()}


def _keys(where: str, data: object, allowed: set[str]) -> None:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping with keys {sorted(allowed)}, got {data!r}")
    extra = sorted(set(map(str, data)) - allowed)
    if extra:
        raise ConfigError(f"{where}: unknown key(s) {extra}; allowed: {sorted(allowed)}")


def _device_from(entry: object, index: int) -> DeviceSpec:
    _keys(f"cluster spec: devices[{index}]", entry, {"name", "type", "node", "speed", "memory_bytes"})
    assert isinstance(entry, Mapping)
    missing = sorted({"name", "memory_bytes"} - set(entry))
    if missing:
        raise ConfigError(f"cluster spec: devices[{index}] lacks required key(s) {missing}")
    return DeviceSpec(**dict(entry))


def _links_from(data: object) -> LinkModel:
    _keys("cluster spec: links", data, {"bandwidth_gbps", "latency_s", "pairs"})
    assert isinstance(data, Mapping)
    pairs = data.get("pairs") or ()
    if not isinstance(pairs, (list, tuple)):
        raise ConfigError(f"cluster spec: links.pairs must be a list of mappings, got {pairs!r}")
    for i, pair in enumerate(pairs):
        _keys(f"cluster spec: links.pairs[{i}]", pair, {"a", "b", "bandwidth_gbps", "latency_s"})
        missing = sorted({"a", "b", "bandwidth_gbps"} - set(pair))
        if missing:
            raise ConfigError(f"cluster spec: links.pairs[{i}] lacks required key(s) {missing}")
    return LinkModel(
        default_bandwidth_gbps=data.get("bandwidth_gbps", DEFAULT_BANDWIDTH_GBPS),
        latency_s=data.get("latency_s", 0.0),
        pairs=tuple(PairLink(**dict(pair)) for pair in _mappings(pairs)),
    )


def _mappings(items: Iterable[object]) -> Iterable[Mapping[str, Any]]:
    for item in items:
        assert isinstance(item, Mapping)
        yield item
