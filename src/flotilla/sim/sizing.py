"""A sizing file: a cluster described by counts of catalogued (or described) accelerators and a
model by its shape, for ``flotilla simulate SIZING.yaml`` (``docs/simulator.md``, "Sizing a
cluster").  No I/O here: the command reads the file and the trace and hands this module plain data.

.. code-block:: yaml

    simulate:
      model: transformer-1.3b          # a catalog name, a transformer shape, or raw figures
      recompute: true                  # full activation recomputation
      mfu: 0.4                         # the fraction of peak a worker's step reaches
      batch_per_worker: 8              # samples per worker step (the global batch grows with workers)
      steps: 1000
      devices:
        - {type: a100-40gb, count: 512}
        - {type: v100-32gb, count: 512, price_per_hour: 1.2}
      trace: {file: traces/aws-p3-spot.csv, time_scale: 1}
      recovery: {detect_s: 0.2, repair_s: 0.05, startup_s: 120}
      strategies: [allreduce, {kind: diloco, inner_steps: 50}]

A device entry names a catalog accelerator (``sim/catalog.py``) and may override any of its
figures, or describes its own (``peak_tflops`` and ``memory_gb`` then required; unless given,
one device per node, 100 Gbit/s within a node, 10 Gbit/s between nodes, price 0).  The links default
to the slowest of the classes' catalog links.  Speeds are relative to the first class: a device's
step takes ``flops_per_sample * batch_per_worker / (peak_tflops * mfu)``.

Memory is compared in GiB (a catalog's "40 GB" taken as 40 GiB).  A cluster whose devices
cannot hold one worker (the model's training state plus a batch's activations) is refused, naming
the device entry; so are unknown names and fields, negative counts or prices (:func:`sizing_of`
raises ``ValueError`` with one line naming the field).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, ValidationError, model_validator

from flotilla.cluster.spec import Link
from flotilla.core.settings import Settings
from flotilla.sim.catalog import ACCELERATORS, MODELS, Accelerator, ModelFigures, ModelShape, model_figures
from flotilla.sim.model import DeviceClass, Recovery, SimCluster, SimJob

__all__ = ["Sizing", "SizingFile", "sizing_of"]

_Pos = Annotated[float, Field(gt=0)]
_NonNeg = Annotated[float, Field(ge=0)]


class ShapeModel(Settings):
    """A transformer's shape (``catalog.ModelShape``)."""

    params: _Pos
    layers: int = Field(ge=1)
    width: int = Field(ge=1)
    heads: int = Field(ge=1)
    seq_len: int = Field(ge=1)


class FiguresModel(Settings):
    """A model given by its figures (any architecture)."""

    flops_per_sample: _Pos
    exchange_bytes: int = Field(ge=0)
    state_bytes: _NonNeg = 0.0
    activation_bytes_per_sample: _NonNeg = 0.0


class DeviceEntry(Settings):
    type: str = Field(min_length=1, max_length=64)
    count: int = Field(ge=1, le=1_000_000)
    per_node: int | None = Field(default=None, ge=1)
    peak_tflops: _Pos | None = None
    memory_gb: _Pos | None = None
    price_per_hour: _NonNeg | None = None
    intra_node_gbps: _Pos | None = None
    inter_node_gbps: _Pos | None = None

    @model_validator(mode="after")
    def _known(self) -> DeviceEntry:
        if self.type not in ACCELERATORS and (self.peak_tflops is None or self.memory_gb is None):
            raise ValueError(
                f"type {self.type!r} is not in the catalog ({', '.join(sorted(ACCELERATORS))}); "
                "describe it with peak_tflops and memory_gb"
            )
        return self

    def resolved(self) -> Accelerator:
        base = ACCELERATORS.get(self.type)
        given = {k: v for k, v in self.model_dump().items() if v is not None and k not in ("type", "count")}
        if base is None:
            return Accelerator(
                name=self.type, peak_tflops=given["peak_tflops"], memory_gb=given["memory_gb"],
                per_node=given.get("per_node", 1), intra_node_gbps=given.get("intra_node_gbps", 100.0),
                inter_node_gbps=given.get("inter_node_gbps", 10.0),
                price_per_hour=given.get("price_per_hour", 0.0),
                instance="(described)",
            )  # fmt: skip
        return dataclasses.replace(base, **given)


class LinksModel(Settings):
    intra_node_gbps: _Pos | None = None
    inter_node_gbps: _Pos | None = None
    intra_node_latency_s: _NonNeg = 5e-6
    inter_node_latency_s: _NonNeg = 5e-5


class TraceModel(Settings):
    file: str = Field(min_length=1, max_length=4096)
    time_scale: _Pos = 1.0
    start_ms: int = Field(default=0, ge=0)


class RecoveryModel(Settings):
    detect_s: _NonNeg = 0.2
    repair_s: _NonNeg = 0.05
    startup_s: _NonNeg = 120.0


class SimulateSection(Settings):
    model: str | ShapeModel | FiguresModel
    recompute: bool = True
    mfu: float = Field(default=0.4, gt=0, le=1)
    batch_per_worker: int = Field(ge=1)
    steps: int = Field(ge=1)
    devices: list[DeviceEntry] = Field(min_length=1)
    links: LinksModel = LinksModel()
    trace: TraceModel | None = None
    recovery: RecoveryModel = RecoveryModel()
    strategies: list[str | dict[str, Any]] = Field(min_length=1)

    @model_validator(mode="after")
    def _model_known(self) -> SimulateSection:
        if isinstance(self.model, str) and self.model not in MODELS:
            raise ValueError(
                f"model {self.model!r} is not in the catalog ({', '.join(sorted(MODELS))}); give its "
                "shape (params, layers, width, heads, seq_len) or its figures (flops_per_sample, "
                "exchange_bytes, ...)"
            )
        types = [d.type for d in self.devices]
        if len(set(types)) != len(types):
            raise ValueError(f"devices: each type once, got {types}")
        return self


class SizingFile(Settings):
    """The file's top level: one ``simulate:`` section."""

    simulate: SimulateSection


@dataclass(frozen=True, kw_only=True, slots=True)
class Sizing:
    """A sizing file resolved: the job and the cluster the simulator runs, the trace section, the
    recovery costs, the strategies (raw: the command resolves them through the registry), and
    per class the accelerator and the memory one worker needs."""

    job: SimJob
    cluster: SimCluster
    recovery: Recovery
    trace: TraceModel | None
    strategies: list[str | dict[str, Any]]
    accelerators: tuple[Accelerator, ...]
    figures: ModelFigures
    worker_bytes: float
    model_name: str


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in ("str", "ShapeModel", "FiguresModel"):
            out += f".{part}" if out else str(part)
    return out


def _one_line(err: ValidationError) -> str:
    problems = []
    for e in err.errors(include_url=False)[:3]:
        msg = str(e["msg"]).removeprefix("Value error, ")
        problems.append(f"{_loc(tuple(e['loc']))}: {msg}" if e["loc"] else msg)
    return "; ".join(problems)


def sizing_of(data: Any) -> Sizing:
    """Validate a sizing file's data and resolve it (see the module doc); ``ValueError`` with one
    line naming the field."""
    try:
        section = SizingFile.model_validate(data).simulate
    except ValidationError as err:
        raise ValueError(_one_line(err)) from None
    if isinstance(section.model, str):
        figures, name = model_figures(MODELS[section.model], recompute=section.recompute), section.model
    elif isinstance(section.model, ShapeModel):
        shape = ModelShape(name="(shape)", **section.model.model_dump())
        figures, name = model_figures(shape, recompute=section.recompute), "(given shape)"
    else:
        figures, name = ModelFigures(**section.model.model_dump()), "(given figures)"
    accs = tuple(d.resolved() for d in section.devices)
    need = figures.state_bytes + section.batch_per_worker * figures.activation_bytes_per_sample
    for i, acc in enumerate(accs):
        if need > acc.memory_gb * 2**30:
            raise ValueError(
                f"simulate.devices[{i}] ({acc.name}, {acc.memory_gb:g} GB) cannot hold one worker: "
                f"{need / 2**30:.1f} GiB (training state {figures.state_bytes / 2**30:.1f} GiB + "
                f"{section.batch_per_worker} samples' activations); lower batch_per_worker, set recompute: "
                "true, or choose devices with more memory"
            )
    ref = accs[0].peak_tflops * section.mfu * 1e12
    classes = tuple(
        DeviceClass(
            type=acc.name, count=entry.count, speed=acc.peak_tflops * section.mfu * 1e12 / ref,
            per_node=acc.per_node, price_per_hour=acc.price_per_hour,
        )
        for entry, acc in zip(section.devices, accs)
    )  # fmt: skip
    links = section.links
    intra = links.intra_node_gbps or min(a.intra_node_gbps for a in accs)
    inter = links.inter_node_gbps or min(a.inter_node_gbps for a in accs)
    cluster = SimCluster(
        classes=classes,
        intra_node=Link(bandwidth_gbps=intra, latency_s=links.intra_node_latency_s),
        inter_node=Link(bandwidth_gbps=inter, latency_s=links.inter_node_latency_s),
    )
    job = SimJob(
        steps=section.steps,
        step_s=figures.flops_per_sample * section.batch_per_worker / ref,
        model_bytes=figures.exchange_bytes,
        batch_per_worker=section.batch_per_worker,
    )
    r = section.recovery
    return Sizing(
        job=job, cluster=cluster, trace=section.trace, strategies=list(section.strategies), accelerators=accs,
        recovery=Recovery(detect_s=r.detect_s, repair_s=r.repair_s, startup_s=r.startup_s),
        figures=figures, worker_bytes=need, model_name=name,
    )  # fmt: skip
