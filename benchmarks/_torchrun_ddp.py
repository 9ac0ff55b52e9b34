"""The checkpoint-and-restart baseline of ``recovery_vs_restart.py``: a plain DDP training script
for ``torchrun`` (gloo, CPU), checkpointing every step and resuming from its checkpoint.

It trains what ``examples/tiny.yaml`` trains with flotilla, rebuilt here without importing
flotilla (each line names the flotilla code it mirrors; ``recovery_vs_restart.py --check-task``
compares the two):

- data: Gaussian blobs (``flotilla.data.datasets.load_synthetic``: 2000 samples, 20 features,
  4 classes, data seed 0), the first 1600 the training split;
- model: ``tiny_mlp`` (``flotilla.models.zoo``: Flatten, Linear(20, 32), ReLU, Linear(32, 4)),
  initialised from a local ``torch.Generator`` seeded with the job seed, weight then bias of each
  layer, ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``;
- order: ``flotilla.data.sampler.GlobalBatchSampler`` (one permutation per data epoch seeded by
  ``(seed, epoch)``, step ``k`` takes the ``k``-th slice of 64, split across ranks like
  ``np.array_split``);
- loss: cross-entropy summed over the rank's samples over the global batch, times the world size
  (DDP averages over ranks), so the gradient is the global-batch mean as in flotilla;
- optimizer: SGD lr 0.1, momentum 0.9;
- speed emulation (``flotilla.cluster.emulation.SpeedEmulator``): the measured forward and backward
  compute are stretched by ``1/speed`` (sleeping the difference; the backward's at the moment its
  gradient bucket is ready, in a DDP communication hook that then runs the default all-reduce).

Checkpoint: after every step rank 0 writes ``{step, model, optimizer}`` to a temporary file, fsyncs
it, renames it over ``ckpt.pt`` and fsyncs the directory.  On (re)start every rank loads
``ckpt.pt`` if it exists and goes on with the next step (a DDP module broadcasts rank 0's
parameters anyway; the optimizer's momentum comes from the file).

Records: one JSON line per event in ``<out>/rank<r>.jsonl`` (appended across restarts), each with
``rank``, ``pid``, ``restart`` (``TORCHELASTIC_RESTART_COUNT``) and ``time_s`` (``time.time()``):
``kind=start`` as the process starts (before importing torch), ``kind=ready`` once the process
group, model and checkpoint are loaded (with ``resume_step``), ``kind=step`` when a step is done
(optimizer stepped and, on rank 0, its checkpoint durable), with ``step``, ``loss`` and ``step_s``.
"""

from __future__ import annotations

import time

T_START = time.time()  # before the imports: what a restart costs includes importing torch

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

NUM_SAMPLES, NUM_FEATURES, NUM_CLASSES, TEST_FRACTION, DATA_SEED = 2000, 20, 4, 0.2, 0
WIDTH, BATCH, LR, MOMENTUM = 32, 64, 0.1, 0.9


def synthetic_train() -> tuple[np.ndarray, np.ndarray]:
    """``load_synthetic(2000, 20, 4, 0.2, seed=0)``'s training split."""
    rng = np.random.default_rng(np.random.SeedSequence([DATA_SEED, NUM_SAMPLES, NUM_FEATURES]))
    centres = rng.normal(0.0, 3.0, size=(NUM_CLASSES, NUM_FEATURES))
    y = rng.permutation(np.arange(NUM_SAMPLES) % NUM_CLASSES).astype(np.int64)
    x = (centres[y] + rng.normal(0.0, 1.0, size=(NUM_SAMPLES, NUM_FEATURES))).astype(np.float32)
    num_train = max(1, min(NUM_SAMPLES - 1, int(NUM_SAMPLES * (1.0 - TEST_FRACTION))))
    return x[:num_train], y[:num_train]


def tiny_mlp(seed: int) -> nn.Sequential:
    """The zoo's ``tiny_mlp`` with its deterministic initialisation."""
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(NUM_FEATURES, WIDTH), nn.ReLU(), nn.Linear(WIDTH, NUM_CLASSES)
    )
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                bound = 1.0 / math.sqrt(module.weight[0].numel())
                module.weight.uniform_(-bound, bound, generator=gen)
                module.bias.uniform_(-bound, bound, generator=gen)
    return model


def shard(num_samples: int, seed: int, step: int, rank: int, world: int) -> tuple[int, np.ndarray]:
    """The global batch's length and ``rank``'s part of it:
    ``GlobalBatchSampler(num_samples, BATCH, seed).batch_len(step)`` and ``.shard(step, rank, world)``."""
    per_epoch = -(-num_samples // BATCH)
    epoch, k = divmod(step, per_epoch)
    perm = np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(num_samples)
    batch = perm[k * BATCH : min((k + 1) * BATCH, num_samples)]
    base, extra = divmod(len(batch), world)
    start = rank * base + min(rank, extra)
    return len(batch), batch[start : start + base + (1 if rank < extra else 0)]


def save_checkpoint(path: Path, obj: dict) -> None:
    """``obj`` to ``path`` durably: a temporary file, fsync, rename, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Stretch:
    """Speed emulation of the backward pass inside DDP's communication hook."""

    def __init__(self, speed: float) -> None:
        self.factor = 1.0 / speed - 1.0 if speed < 1.0 else 0.0
        self.since = time.perf_counter()

    def sleep_since(self) -> None:
        if self.factor > 0:
            time.sleep(max(0.0, time.perf_counter() - self.since) * self.factor)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True, help="checkpoint and records directory")
    ap.add_argument("--speed", type=float, default=1.0, help="emulated speed (compute lasts 1/speed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--timeout-s", type=float, default=60.0, help="gloo collective timeout")
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = open(a.out / f"rank{rank}.jsonl", "a", buffering=1, encoding="utf-8")

    def record(kind: str, **fields: object) -> None:
        log.write(
            json.dumps({"kind": kind, "rank": rank, "pid": os.getpid(), "restart": restart, **fields}) + "\n"
        )

    record("start", time_s=T_START)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=a.timeout_s))
    x_train, y_train = synthetic_train()
    x_all, y_all = torch.from_numpy(x_train), torch.from_numpy(y_train)
    torch.manual_seed(a.seed)
    model = tiny_mlp(a.seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ckpt = a.out / "ckpt.pt"
    first = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        first = int(state["step"]) + 1
    ddp = DistributedDataParallel(model)
    stretch = Stretch(a.speed)

    def hook(state, bucket):  # (no annotations: DDP checks them, and they are strings here)
        stretch.sleep_since()  # the backward compute up to this bucket, stretched
        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, hook)
    record("ready", time_s=time.time(), resume_step=first)
    for step in range(first, a.steps):
        t0 = time.perf_counter()
        global_batch, idx = shard(len(y_train), a.seed, step, rank, world)
        x, y = x_all[torch.from_numpy(idx)], y_all[torch.from_numpy(idx)]
        opt.zero_grad(set_to_none=True)
        stretch.since = time.perf_counter()
        loss_sum = nn.functional.cross_entropy(ddp(x), y, reduction="sum")
        stretch.sleep_since()  # the forward compute, stretched
        stretch.since = time.perf_counter()
        (loss_sum * (world / global_batch)).backward()
        opt.step()
        if rank == 0:
            save_checkpoint(ckpt, {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()})
        record(
            "step",
            time_s=time.time(),
            step=step,
            loss=loss_sum.item() / max(1, len(y)),
            step_s=time.perf_counter() - t0,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
