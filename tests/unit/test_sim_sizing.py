"""Sizing files and the catalog (``sim/sizing.py``, ``sim/catalog.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from flotilla.sim.catalog import ACCELERATORS, MODELS, model_figures
from flotilla.sim.sizing import sizing_of

ROOT = Path(__file__).resolve().parents[2]


def _data(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "transformer-1.3b",
        "batch_per_worker": 8,
        "steps": 100,
        "devices": [{"type": "a100-40gb", "count": 16}, {"type": "v100-32gb", "count": 8}],
        "strategies": ["allreduce"],
    }
    body.update(over)
    return {"simulate": body}


def test_the_transformer_formulas() -> None:
    shape = MODELS["transformer-1.3b"]
    f = model_figures(shape, recompute=False)
    n, L, d, T = 1.3e9, 24, 2048, 2048
    assert f.flops_per_sample == pytest.approx((6 * n + 6 * L * d * T) * T)
    assert f.state_bytes == pytest.approx(16 * n) and f.exchange_bytes == int(2 * n)
    assert f.activation_bytes_per_sample == pytest.approx(T * d * L * (34 + 5 * 16 * T / d))
    r = model_figures(shape, recompute=True)
    assert r.flops_per_sample == pytest.approx(f.flops_per_sample * 8 / 6)
    assert r.activation_bytes_per_sample == pytest.approx(2 * T * d * L)


def test_a_sizing_file_becomes_classes_relative_to_the_first() -> None:
    s = sizing_of(_data(mfu=0.5))
    a100, v100 = ACCELERATORS["a100-40gb"], ACCELERATORS["v100-32gb"]
    assert [(c.type, c.count) for c in s.cluster.classes] == [("a100-40gb", 16), ("v100-32gb", 8)]
    assert s.cluster.classes[1].speed == pytest.approx(v100.peak_tflops / a100.peak_tflops)
    flops = model_figures(MODELS["transformer-1.3b"]).flops_per_sample
    assert s.job.step_s == pytest.approx(flops * 8 / (a100.peak_tflops * 0.5e12))
    # links: the slowest of the classes' unless given
    assert s.cluster.inter_node.bandwidth_gbps == min(a100.inter_node_gbps, v100.inter_node_gbps)
    assert s.cluster.classes[0].price_per_hour == pytest.approx(a100.price_per_hour)
    assert s.job.model_bytes == int(2 * 1.3e9) and s.job.batch_per_worker == 8


def test_a_device_entry_overrides_the_catalog_or_describes_its_own() -> None:
    devices = [
        {"type": "a100-40gb", "count": 4, "price_per_hour": 1.25},
        {"type": "mygpu", "count": 2, "peak_tflops": 156.0, "memory_gb": 48, "per_node": 2},
    ]
    s = sizing_of(_data(devices=devices, links={"inter_node_gbps": 40}))
    assert s.cluster.classes[0].price_per_hour == 1.25
    assert s.cluster.classes[1].speed == pytest.approx(0.5) and s.cluster.classes[1].per_node == 2
    assert s.cluster.inter_node.bandwidth_gbps == 40


def test_a_model_by_its_figures() -> None:
    model = {"flops_per_sample": 1e12, "exchange_bytes": 1000, "state_bytes": 1e9}
    s = sizing_of(_data(model=model, batch_per_worker=4))
    assert s.job.model_bytes == 1000
    assert s.job.step_s == pytest.approx(4e12 / (ACCELERATORS["a100-40gb"].peak_tflops * 0.4e12))


@pytest.mark.parametrize(
    ("over", "expected"),
    [
        ({"devices": [{"type": "v100-16gb", "count": 2}]}, "devices[0] (v100-16gb, 16 GB) cannot hold"),
        ({"recompute": False}, "simulate.devices[0] (a100-40gb, 40 GB) cannot hold one worker"),
        ({"devices": [{"type": "tpu", "count": 2}]}, "simulate.devices[0]: type 'tpu' is not in the catalog"),
        ({"devices": [{"type": "t4", "count": 0}]}, "simulate.devices[0].count"),
        ({"devices": [{"type": "t4", "count": 1, "price_per_hour": -1}]}, "devices[0].price_per_hour"),
        ({"model": "gpt-9"}, "model 'gpt-9' is not in the catalog"),
        ({"mfu": 1.5}, "simulate.mfu"),
        ({"colour": "red"}, "simulate.colour: Extra inputs are not permitted"),
        ({"strategies": []}, "simulate.strategies"),
    ],
)
def test_bad_sizing_files_are_refused_naming_the_field(over: dict[str, Any], expected: str) -> None:
    data = _data(**over)
    if over.get("recompute") is False:
        data["simulate"]["devices"] = [{"type": "a100-40gb", "count": 2}]
    with pytest.raises(ValueError) as err:
        sizing_of(data)
    assert expected in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_the_shipped_example_is_valid_and_sized_as_it_says() -> None:
    data = yaml.safe_load((ROOT / "examples" / "sizing_1024.yaml").read_text())
    s = sizing_of(data)
    assert sum(c.count for c in s.cluster.classes) == 1024
    assert {c.type for c in s.cluster.classes} == {"a100-40gb", "v100-32gb"}
    assert s.trace is not None and (ROOT / "examples" / s.trace.file).is_file()
    assert s.worker_bytes < ACCELERATORS["v100-32gb"].memory_gb * 2**30
