"""An example catalog of accelerators and model shapes for sizing questions (pure data;
``docs/simulator.md``, "Sizing a cluster").

Every figure below is a published one, with its source; none was measured here (``flotilla
calibrate`` measures only this machine).  They are *examples*: a sizing file may give its own
figures for any field, and should for prices (spot prices change by the hour and by region).

**Accelerators** (:class:`Accelerator`): dense 16-bit tensor throughput (``peak_tflops``), memory,
the per-direction bandwidth between two devices of one machine (``intra_node_gbps``) and the
machine's network (``inter_node_gbps``), the machines' per-device on-demand price.

- NVIDIA datasheets: Tesla V100 (SXM2: 125 TFLOPS tensor, 16/32 GB HBM2, NVLink 300 GB/s
  bidirectional), A100 (SXM4: 312 TFLOPS BF16 dense, 40 GB, NVLink 600 GB/s), H100 (SXM5: 989
  TFLOPS BF16 dense, 80 GB, NVLink 900 GB/s), T4 (65 TFLOPS FP16 tensor, 16 GB, PCIe Gen3 x16:
  about 15.75 GB/s).  Per-direction NVLink bandwidth is half the bidirectional figure.
- AWS EC2 instance pages and on-demand price list (Linux, us-east-1, as published in 2023): p3.16xlarge
  (8 x V100-16GB, 25 Gbps, $24.48/h), p3dn.24xlarge (8 x V100-32GB, 100 Gbps, $31.212/h),
  p4d.24xlarge (8 x A100-40GB, 400 Gbps, $32.7726/h), p5.48xlarge (8 x H100, 3,200 Gbps,
  $98.32/h), g4dn.12xlarge (4 x T4, 50 Gbps, $3.912/h); the price per device is the machine's
  divided by its devices.

**Model shapes** (:class:`ModelShape`): a decoder-only transformer's parameters, layers, width and
sequence length, from which :func:`model_figures` derives the training FLOPs and memory with the
usual formulas:

- FLOPs per token, training: ``6 N + 6 L d T`` (Kaplan et al. 2020, "Scaling laws for neural
  language models", section 2.1: a forward pass is ``2 N + 2 L T d``, the backward twice that);
  with full activation recomputation one more forward pass: ``8 N + 8 L d T``;
- memory: 16 bytes per parameter for mixed-precision Adam (16-bit weights and gradients, 32-bit
  master weights and two moments: Rajbhandari et al. 2020, "ZeRO", section 3.1), plus the
  activations: ``2 T d L`` bytes per sequence with full recomputation (Korthikanti et al. 2022,
  "Reducing activation recomputation in large transformer models", section 4.3), or
  ``T d L (34 + 5 a T / d)`` bytes without (their equation 2, ``a`` heads);
- what one exchange moves: the 16-bit gradients or weights, 2 bytes per parameter.

Shapes: GPT-3 XL, 1.3 B parameters, 24 layers, width 2,048, 2,048-token context, 16 heads of 128
(Brown et al. 2020, "Language models are few-shot learners", table 2.1: its 24 heads do not match
its width; 16 heads of 128 do); GPT-3 Medium, 350 M, 24 layers, width 1,024, 16 heads; GPT-2
small, 124 M, 12 layers, width 768, 1,024-token context, 12 heads (Radford et al. 2019).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ACCELERATORS",
    "MODELS",
    "Accelerator",
    "ModelFigures",
    "ModelShape",
    "accelerator",
    "model_figures",
    "model_shape",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Accelerator:
    """One accelerator type: ``peak_tflops`` dense 16-bit, ``memory_gb``, ``per_node`` devices in
    the catalog's machine, its links (Gbit/s, one direction) and ``price_per_hour`` per device
    (on-demand; ``instance`` names the machine the figures are from)."""

    name: str
    peak_tflops: float
    memory_gb: float
    per_node: int
    intra_node_gbps: float
    inter_node_gbps: float
    price_per_hour: float
    instance: str


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator(name="v100-16gb", peak_tflops=125.0, memory_gb=16.0, per_node=8, intra_node_gbps=1200.0,
                    inter_node_gbps=25.0, price_per_hour=24.48 / 8, instance="p3.16xlarge"),
        Accelerator(name="v100-32gb", peak_tflops=125.0, memory_gb=32.0, per_node=8, intra_node_gbps=1200.0,
                    inter_node_gbps=100.0, price_per_hour=31.212 / 8, instance="p3dn.24xlarge"),
        Accelerator(name="a100-40gb", peak_tflops=312.0, memory_gb=40.0, per_node=8, intra_node_gbps=2400.0,
                    inter_node_gbps=400.0, price_per_hour=32.7726 / 8, instance="p4d.24xlarge"),
        Accelerator(name="h100-80gb", peak_tflops=989.0, memory_gb=80.0, per_node=8, intra_node_gbps=3600.0,
                    inter_node_gbps=3200.0, price_per_hour=98.32 / 8, instance="p5.48xlarge"),
        Accelerator(name="t4", peak_tflops=65.0, memory_gb=16.0, per_node=4, intra_node_gbps=126.0,
                    inter_node_gbps=50.0, price_per_hour=3.912 / 4, instance="g4dn.12xlarge"),
    )
}  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """A decoder-only transformer: ``params``, ``layers``, ``width`` (d_model), ``heads``,
    ``seq_len`` tokens per sample."""

    name: str
    params: float
    layers: int
    width: int
    heads: int
    seq_len: int


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape(name="transformer-1.3b", params=1.3e9, layers=24, width=2048, heads=16, seq_len=2048),
        ModelShape(name="transformer-350m", params=3.5e8, layers=24, width=1024, heads=16, seq_len=2048),
        ModelShape(name="gpt2-124m", params=1.24e8, layers=12, width=768, heads=12, seq_len=1024),
    )
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFigures:
    """What the simulator needs of a model: training FLOPs per sample, the bytes one exchange
    moves, the bytes of its training state and of one sample's activations."""

    flops_per_sample: float
    exchange_bytes: int
    state_bytes: float
    activation_bytes_per_sample: float


def model_figures(shape: ModelShape, *, recompute: bool = True) -> ModelFigures:
    """The formulas of the module doc for ``shape``; ``recompute``: full activation
    recomputation (one more forward pass, far less activation memory)."""
    n, L, d, T = shape.params, shape.layers, shape.width, shape.seq_len
    passes = 8.0 if recompute else 6.0  # (forward 2, backward 4, recomputed forward 2)
    per_token = passes * n + passes * L * d * T
    acts = 2.0 * T * d * L if recompute else T * d * L * (34.0 + 5.0 * shape.heads * T / d)
    return ModelFigures(
        flops_per_sample=per_token * T,
        exchange_bytes=int(2 * n),
        state_bytes=16.0 * n,
        activation_bytes_per_sample=acts,
    )


def accelerator(name: str) -> Accelerator:
    """The catalog's accelerator ``name``; ``KeyError`` naming the known ones."""
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise KeyError(f"unknown accelerator {name!r}; the catalog has {sorted(ACCELERATORS)}") from None


def model_shape(name: str) -> ModelShape:
    """The catalog's model ``name``; ``KeyError`` naming the known ones."""
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; the catalog has {sorted(MODELS)}") from None
