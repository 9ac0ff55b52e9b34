"""Datasets (shapes, determinism, caching, RNG hygiene); model zoo (shapes, seeds, training)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flotilla.core.errors import ConfigError
from flotilla.data.datasets import ArrayDataset, load_dataset, load_mnist1d, load_synthetic
from flotilla.models.zoo import build_model, count_parameters

# ---------------------------------------------------------------------------------- datasets


def test_synthetic_shapes_dtypes_and_determinism():
    ds = load_synthetic(num_samples=500, num_features=8, num_classes=3, test_fraction=0.2, seed=5)
    assert ds.x_train.shape == (400, 8) and ds.x_test.shape == (100, 8)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert ds.num_classes == 3 and ds.input_shape == (8,)
    assert set(np.unique(ds.y_train)) == {0, 1, 2}
    again = load_synthetic(num_samples=500, num_features=8, num_classes=3, seed=5)
    np.testing.assert_array_equal(ds.x_train, again.x_train)
    np.testing.assert_array_equal(ds.y_test, again.y_test)
    other = load_synthetic(num_samples=500, num_features=8, num_classes=3, seed=6)
    assert not np.array_equal(ds.x_train, other.x_train)
    x, y = ds.train_tensors()
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and tuple(x.shape) == (400, 8)
    xt, yt = ds.test_tensors()
    assert tuple(xt.shape) == (100, 8) and torch.equal(yt, torch.from_numpy(ds.y_test))


def test_mnist1d_generated_offline_cached_and_rng_untouched(tmp_path):
    random.seed(123)
    np.random.seed(123)
    py_before, np_before = random.random(), np.random.random()
    random.seed(123)
    np.random.seed(123)
    ds = load_mnist1d(num_samples=200, test_fraction=0.25, seed=3, cache_dir=tmp_path)
    assert (random.random(), np.random.random()) == (py_before, np_before)  # global RNGs restored
    assert ds.x_train.shape == (150, 1, 40) and ds.x_test.shape == (50, 1, 40)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert ds.num_classes == 10 and ds.y_train.min() >= 0 and ds.y_train.max() <= 9
    assert abs(float(np.concatenate([ds.x_train, ds.x_test]).std()) - 1.0) < 1e-3  # standardised
    files = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".npz")
    assert len(files) == 1 and files[0].startswith("mnist1d_n200_s3_")
    with np.load(tmp_path / files[0], allow_pickle=False) as npz:  # a plain, pickle-free npz
        np.testing.assert_array_equal(npz["x_train"], ds.x_train)
    cached = load_mnist1d(num_samples=200, test_fraction=0.25, seed=3, cache_dir=tmp_path)
    np.testing.assert_array_equal(cached.x_test, ds.x_test)
    np.testing.assert_array_equal(cached.y_train, ds.y_train)


def test_mnist1d_cache_is_keyed_by_arguments_and_survives_corruption(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOTILLA_CACHE", str(tmp_path))
    a = load_dataset("mnist1d", num_samples=100, seed=1)
    b = load_mnist1d(num_samples=100, seed=2)
    assert len(list(tmp_path.glob("*.npz"))) == 2
    assert not np.array_equal(a.x_train, b.x_train)
    path = next(tmp_path.glob("mnist1d_n100_s1_*.npz"))
    path.write_bytes(b"not an npz")
    again = load_mnist1d(num_samples=100, seed=1)
    np.testing.assert_array_equal(again.x_train, a.x_train)


def test_dataset_registry_and_validation():
    ds = load_dataset("synthetic", num_samples=50, num_features=3)
    assert ds.input_shape == (3,)
    with pytest.raises(ValueError, match="mnist1d.*synthetic"):
        load_dataset("cifar10")
    with pytest.raises(ConfigError, match="test_fraction"):
        load_synthetic(test_fraction=1.0)
    with pytest.raises(ConfigError, match="float32"):
        ArrayDataset(
            x_train=np.zeros((2, 3)),
            y_train=np.zeros(2, np.int64),
            x_test=np.zeros((1, 3), np.float32),
            y_test=np.zeros(1, np.int64),
            num_classes=2,
        )
    with pytest.raises(ConfigError, match="labels"):
        ArrayDataset(
            x_train=np.zeros((2, 3), np.float32),
            y_train=np.array([0, 5]),
            x_test=np.zeros((1, 3), np.float32),
            y_test=np.zeros(1, np.int64),
            num_classes=2,
        )


# ------------------------------------------------------------------------------------ models


@pytest.mark.parametrize(
    ("name", "shape"),
    [("cnn1d", (1, 40)), ("mlp", (1024,)), ("tiny_mlp", (20,)), ("tiny_mlp", (2, 5))],
)
def test_model_output_shapes(name, shape):
    model = build_model(name, input_shape=shape, num_classes=7)
    assert isinstance(model, nn.Sequential)
    out = model(torch.zeros(3, *shape))
    assert tuple(out.shape) == (3, 7) and out.dtype == torch.float32


def test_mlp_parameter_count():
    model = build_model("mlp", input_shape=(1024,), num_classes=10)
    assert count_parameters(model) == 2_894_090
    assert 2_800_000 <= count_parameters(model) <= 3_000_000


def test_cnn1d_is_small_and_width_overrides():
    small = build_model("cnn1d", input_shape=(1, 40), num_classes=10)
    assert count_parameters(small) == 93_898
    tiny = build_model("tiny_mlp", input_shape=(20,), num_classes=4, width=8)
    assert count_parameters(tiny) == 20 * 8 + 8 + 8 * 4 + 4
    wide = build_model("cnn1d", input_shape=(1, 40), num_classes=10, width=8)
    assert count_parameters(wide) < count_parameters(small)


@pytest.mark.parametrize("name", ["cnn1d", "tiny_mlp"])
def test_init_is_deterministic_by_seed_and_leaves_global_rng(name):
    shape = (1, 40)
    state = torch.get_rng_state()
    a = build_model(name, input_shape=shape, num_classes=10, seed=11).state_dict()
    b = build_model(name, input_shape=shape, num_classes=10, seed=11).state_dict()
    c = build_model(name, input_shape=shape, num_classes=10, seed=12).state_dict()
    assert torch.equal(torch.get_rng_state(), state)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert all(torch.isfinite(v).all() and v.abs().max() > 0 for v in a.values())


def test_init_matches_pytorch_default_bounds():
    model = build_model("tiny_mlp", input_shape=(100,), num_classes=3, seed=0)
    first = model[1]
    assert isinstance(first, nn.Linear)
    weight = first.weight.detach()
    bound = 1 / np.sqrt(100)
    assert 0.9 * bound < weight.abs().max().item() <= bound
    assert weight.std().item() == pytest.approx(bound / np.sqrt(3), rel=0.1)


def test_unknown_model_and_bad_arguments():
    with pytest.raises(ValueError, match="cnn1d.*mlp.*tiny_mlp"):
        build_model("resnet50", input_shape=(3,), num_classes=2)
    with pytest.raises(ValueError, match="input_shape"):
        build_model("cnn1d", input_shape=(40,), num_classes=10)
    with pytest.raises(ValueError, match="input_shape"):
        build_model("mlp", input_shape=(), num_classes=10)


@pytest.fixture
def one_thread():
    """Small models train ~20x faster on one thread when the 2 cores are busy; restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["tiny_mlp", "cnn1d"])
def test_short_training_on_synthetic_reduces_loss(name, one_thread):
    ds = load_synthetic(num_samples=512, num_features=16, num_classes=4, seed=0)
    x, y = ds.train_tensors()
    shape = (16,) if name == "tiny_mlp" else (1, 16)
    x = x.reshape(len(x), *shape)
    model = build_model(name, input_shape=shape, num_classes=4, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with torch.no_grad():
        initial = F.cross_entropy(model(x), y).item()
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for idx in torch.randperm(len(y), generator=gen).split(32):
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    with torch.no_grad():
        final = F.cross_entropy(model(x), y).item()
        acc = (model(x).argmax(1) == y).float().mean().item()
    assert final < 0.5 * initial
    assert acc > 0.9
