"""flotilla's cost over a plain PyTorch loop: the same task, samples, optimizer, seed and batch size,
trained (a) by a plain single-process loop and (b) by `flotilla run` with strategy allreduce and
1 worker (and 2 workers, as extra information), alternating in one run over rounds.

What is compared
- **training time**: plain: from the start of its first step to the end of its last
  (``perf_counter`` in the loop); flotilla: the same span from its own metrics records (each
  record's ``time_s`` is the end of a step, ``step_s`` its duration), so start-up, the final
  evaluation and the model export are not in it.  ``ratio = flotilla (1 worker) / plain``, the
  median over rounds of the per-round ratios; the last line is ``ratio=<that>``.
- **steady state**: the time of steps ``K+1..N`` alone (``--steady-from K``, default 50: the
  issue's "sums over steps 50-300"), from each contender's step ends, so compilation, allocator
  and kernel warm-up of the first steps are out of it; printed as the median steady-state ratio.
- **start-up**: from the process start (``Popen``) to the start of the first step.  For flotilla
  the first step's start is ``t0 + time_s - step_s`` of its first record, with ``t0`` the
  coordinator's start (``summary.json``'s ``t0_unix`` when the launcher provides it, else asked
  once from the live coordinator with its ``status`` call: ``now - elapsed_s``).
- **CPU**: CPU seconds of the run's processes (``RUSAGE_CHILDREN``) over its wall time, i.e. the
  cores it kept busy, and the machine's busy fraction over the run (``/proc/stat``, other tenants
  included) -- a loaded machine makes the figures move.

The plain loop is what a user would write: ``torch.manual_seed(seed)``, ``task.build_model()``,
the same optimizer, a ``DataLoader(shuffle=True)`` over a map-style data set (a shuffled
index slice for a pair of tensors), ``loss.backward(); optimizer.step()``, one ``float(loss)``
per step.  ``--device cuda``: both on ``cuda:0``, the batch copied there each step, and the same
optimizer kernel in both (torch's fused Adam/AdamW: what flotilla builds for CUDA parameters);
``--precision bf16``: both under ``torch.autocast`` in bfloat16.  flotilla runs with its
defaults (metrics every step, a parameter digest every 100), ``job.eval_every_steps: 0``.  Threads: each
contender's default (torch's: one per core; flotilla's: cores / local workers) unless
``--threads N`` sets N for both.  On a machine other jobs share, use ``--threads 1``: an OpenMP
team of 2 threads whose second thread is descheduled waits in its barrier, and steps then take
10-100x longer, for the plain loop and flotilla alike (seen here at a load average of 5-12 on
2 cores), which swamps the overhead being measured.

``--against SRC`` adds a contender ``against1``: ``flotilla run`` with 1 worker from another source
tree (``SRC`` is its ``src/`` directory, e.g. of a ``git worktree`` at an older commit, put first on
``PYTHONPATH``), in the same rounds; the last line is then ``before_after=``, the median over
rounds of ``flotilla1 / against1`` training time (this tree against the other, both at the same
moment of the machine), with each one's ratio to plain above it.  That is the check "no worse than
before" without comparing two noisy ratios from different runs.

``--profile DIR`` instead runs each contender once under cProfile (the flotilla worker started by
hand beside ``flotilla coordinator``) and prints where the time goes.

    .venv/bin/python benchmarks/overhead_vs_plain.py --quick          # a couple of minutes
    .venv/bin/python benchmarks/overhead_vs_plain.py --json runs/overhead.json
    .venv/bin/python benchmarks/overhead_vs_plain.py --task regression --rounds 5 --threads 1
    python3 benchmarks/overhead_vs_plain.py --device cuda --task transformer --batch 32 --workers 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Children, alternating_orders, machine_info, median, percentile, python, report_medians

ROOT = Path(__file__).resolve().parents[1]
TASKS = {
    # name: (task path, task_args, optimizer)
    "spirals": (
        str(ROOT / "examples" / "own_task" / "task.py") + ":Spirals",
        {"width": 64, "depth": 3, "num_samples": 6000, "num_arms": 3, "noise": 0.15, "seed": 0},
        {"kind": "adam", "lr": 0.003},
    ),
    "regression": (
        str(ROOT / "examples" / "own_task" / "regression.py") + ":Regression",
        {"num_samples": 5000, "num_inputs": 8, "width": 64, "noise": 0.1, "seed": 0},
        {"kind": "adam", "lr": 0.003},
    ),
    # the GPU comparison of issue 34 (use --batch 32): an 8-layer transformer LM, width 512, 8 heads,
    # sequence 256, vocabulary 8192, AdamW, fp32 (the user's own task: examples/own_task/gpt.py)
    "transformer": (
        str(ROOT / "examples" / "own_task" / "gpt.py") + ":TinyGPT",
        {"vocab": 8192, "seq_len": 256, "dim": 512, "layers": 8, "heads": 8, "num_samples": 4096, "seed": 0},
        {"kind": "adamw", "lr": 0.0003},
    ),
    # its CPU proxy: the same code, small enough that a CPU step is short (host costs show)
    "transformer-tiny": (
        str(ROOT / "examples" / "own_task" / "gpt.py") + ":TinyGPT",
        {"vocab": 64, "seq_len": 32, "dim": 32, "layers": 2, "heads": 2, "num_samples": 4096, "seed": 0},
        {"kind": "adamw", "lr": 0.001},
    ),
}


# ---------------------------------------------------------------------------------- plain loop
def _optimizer(params: Any, spec: dict[str, Any], fused: bool = False) -> Any:
    """The plain loop's optimizer; ``fused``: torch's fused Adam/AdamW, what flotilla builds for
    CUDA parameters (trainer/optim.py), so both contenders run the same optimizer."""
    import torch

    kind = spec["kind"]
    extra = {"fused": True} if fused else {}
    if kind == "adam":
        return torch.optim.Adam(params, lr=spec["lr"], **extra)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=spec["lr"], **extra)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=spec["lr"], momentum=spec.get("momentum", 0.9))
    raise SystemExit(f"unsupported optimizer {kind!r}")


def _batches(data: Any, batch: int, seed: int) -> Any:
    """Endless shuffled batches, epoch after epoch, as a plain loop would draw them."""
    import torch
    from torch.utils.data import DataLoader

    g = torch.Generator().manual_seed(seed)
    if isinstance(data, tuple):
        x, y = data
        while True:
            perm = torch.randperm(x.shape[0], generator=g)
            for i in range(0, x.shape[0], batch):
                idx = perm[i : i + batch]
                yield x[idx], y[idx]
    loader = DataLoader(data, batch_size=batch, shuffle=True, generator=g)
    while True:
        yield from loader


def plain_child(a: argparse.Namespace) -> None:
    """The baseline, in its own process: writes its timings to ``a.out`` (JSON)."""
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    from flotilla.trainer.task_load import load_task  # the user's class by its path, nothing more

    path, args, opt = TASKS[a.task]
    task = load_task(path, args)
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    model = task.build_model().to(device)
    optimizer = _optimizer(model.parameters(), opt, fused=device.type == "cuda")
    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
        if a.precision == "bf16"
        else contextlib.nullcontext
    )
    batches = _batches(task.train_data(), a.batch, a.seed)
    t_first_unix = time.time()
    t0 = time.perf_counter()
    losses, ends = [], []
    for _ in range(a.steps):
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = task.loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        ends.append(time.perf_counter())
    train_s = time.perf_counter() - t0
    result = {
        "train_s": train_s,
        "first_step_unix": t_first_unix,
        "threads": torch.get_num_threads(),
        "median_step_s": median([b - a_ for a_, b in zip([t0, *ends], ends)]),
        **_tail([b - a_ for a_, b in zip([t0, *ends], ends)]),
        "steady_s": _steady(ends, a.steady_from),
        "first_loss": losses[0],
        "last_loss": sum(losses[-20:]) / len(losses[-20:]),
    }
    Path(a.out).write_text(json.dumps(result))


def _steady(ends: list[float], skip: int) -> float:
    """The time of steps ``skip + 1 .. N`` (the issue's "sums over steps 50-300"): from the end of
    step ``skip`` to the end of the last, so start-up, compilation and the first steps' warm-up
    are not in it; the whole span when the run has no more than ``skip`` steps."""
    k = skip if len(ends) > skip else 0
    return ends[-1] - ends[k - 1] if k else ends[-1] - ends[0]


def _tail(steps: list[float]) -> dict[str, float]:
    """Where a training time beyond ``steps x median`` comes from: the p90 and the longest step,
    and the time spent beyond twice the median (slow steps: warm-up, collections, bursts)."""
    if not steps:
        return {}
    med = median(steps)
    return {
        "p90_step_s": percentile(steps, 90.0),
        "max_step_s": max(steps),
        "beyond_2x_median_s": sum(s - 2 * med for s in steps if s > 2 * med),
    }


def run_plain(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    out = work / "plain.json"
    argv = [python(), __file__, "--child-plain", "--out", str(out), *_shared_args(a)]
    with Children() as kids:
        launched = time.time()
        proc = kids.start(argv)
        if proc.wait(timeout=a.timeout_s) != 0:
            raise SystemExit(f"plain loop failed with exit code {proc.returncode}")
        wall = time.time() - launched
    res = json.loads(out.read_text())
    res["startup_s"] = res.pop("first_step_unix") - launched
    res["wall_s"] = wall
    return res


def _shared_args(a: argparse.Namespace) -> list[str]:
    return [
        "--task",
        a.task,
        "--steps",
        str(a.steps),
        "--batch",
        str(a.batch),
        "--seed",
        str(a.seed),
        "--threads",
        str(a.threads),
        "--device",
        a.device,
        "--precision",
        a.precision,
        "--steady-from",
        str(a.steady_from),
    ]


# ---------------------------------------------------------------------------------- flotilla
def flotilla_config(a: argparse.Namespace, num_workers: int) -> dict[str, Any]:
    path, args, opt = TASKS[a.task]
    return {
        "cluster": {
            # (device and precision only where not the default: --against runs older trees too)
            "workers": [
                {"name": f"w{i}", **({"device": a.device} if a.device != "cpu" else {})}
                for i in range(num_workers)
            ],
            "host": "127.0.0.1",
        },
        "job": {
            "task": path,
            "task_args": args,
            "optimizer": opt,
            "batch_size": a.batch,
            "steps": a.steps,
            "seed": a.seed,
            "eval_every_steps": 0,
            **({"precision": a.precision} if a.precision != "fp32" else {}),
        },
        "strategy": {"kind": "allreduce"},
    }


def _coordinator_t0(run_dir: Path, proc: subprocess.Popen, timeout_s: float) -> float | None:
    """The coordinator's start (unix time): ``now - elapsed_s`` of one ``status`` call, made as
    soon as ``coordinator.json`` appears (None if the run ends first)."""
    from flotilla.comm.auth import read_secret_file
    from flotilla.comm.msgplane import connect

    info_file = run_dir / "coordinator.json"
    deadline = time.monotonic() + timeout_s
    while not info_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            return None
        time.sleep(0.005)
    info = json.loads(info_file.read_text())
    client = connect(info["address"], read_secret_file(Path(info["secret_file"])), sender="bench")
    try:
        before = time.time()
        body = client.call("status", {}, timeout_s=10.0).body
        after = time.time()
    finally:
        client.close()
    return (before + after) / 2 - float(body["elapsed_s"])


def run_flotilla(
    a: argparse.Namespace, work: Path, num_workers: int, src: str | None = None
) -> dict[str, Any]:
    """One ``flotilla run``; with ``src``, from that source tree (first on ``PYTHONPATH``)."""
    import yaml

    from flotilla.report.metrics import read_metrics

    tag = f"{'against' if src else 'flotilla'}{num_workers}"
    cfg_file, report, run_dir = work / f"{tag}.yaml", work / f"{tag}-report", work / f"{tag}-run"
    cfg_file.write_text(yaml.safe_dump(flotilla_config(a, num_workers)))
    argv = [python(), "-m", "flotilla.cli.main", "run", str(cfg_file), "--report", str(report)]
    argv += ["--run-dir", str(run_dir), "--no-progress", *(x for kv in a.set for x in ("--set", kv))]
    with open(work / f"{tag}.log", "w") as log, Children() as kids:
        launched = time.time()
        env = dict(os.environ)
        if a.threads:
            env["FLOTILLA_TORCH_THREADS"] = str(a.threads)
        if src:
            env["PYTHONPATH"] = os.pathsep.join(x for x in (src, env.get("PYTHONPATH")) if x)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        kids.procs.append(proc)
        t0 = _coordinator_t0(run_dir, proc, a.timeout_s)
        if proc.wait(timeout=a.timeout_s) != 0:
            log.flush()
            tail = (work / f"{tag}.log").read_text()[-2000:]
            raise SystemExit(f"flotilla run failed with exit code {proc.returncode}:\n{tail}")
        wall = time.time() - launched
    summary = json.loads((report / "summary.json").read_text())
    t0 = summary.get("t0_unix", t0)
    steps = [r for r in read_metrics(report) if r.get("committed") and "step_s" in r]
    start = min(float(r["time_s"]) - float(r["step_s"]) for r in steps)
    end = max(float(r["time_s"]) for r in steps)
    rank0 = sorted((r for r in steps if r.get("rank") == 0), key=lambda r: r["step"])
    ends = [float(r["time_s"]) for r in rank0]
    gaps = [b - a_ - float(r["step_s"]) for a_, b, r in zip(ends, ends[1:], rank0[1:])]
    return {
        "train_s": end - start,
        "startup_s": None if t0 is None else t0 + start - launched,
        "wall_s": wall,
        "steps": summary["steps"],
        "mean_step_s": sum(float(r["step_s"]) for r in rank0) / len(rank0),
        "mean_compute_s": sum(float(r.get("compute_s", 0.0)) for r in rank0) / len(rank0),
        "mean_between_steps_s": sum(gaps) / len(gaps) if gaps else 0.0,
        "median_step_s": median([b - a_ for a_, b in zip(ends, ends[1:])]),
        "steady_s": _steady(ends, a.steady_from),
        **_tail([b - a_ for a_, b in zip(ends, ends[1:])]),
        "last_loss": sum(float(r["loss"]) for r in rank0[-20:]) / len(rank0[-20:]),
    }


# ---------------------------------------------------------------------------------- CPU figures
def _proc_stat() -> tuple[float, float]:
    try:
        with open("/proc/stat", encoding="utf-8") as fh:
            fields = [float(x) for x in fh.readline().split()[1:]]
    except OSError:
        return 0.0, 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields) - idle, sum(fields)


def measured(fn: Any, *args: Any) -> dict[str, Any]:
    """``fn(*args)`` with the CPU its child processes used and the machine's busy fraction."""
    ru0, (busy0, total0), t0 = resource.getrusage(resource.RUSAGE_CHILDREN), _proc_stat(), time.monotonic()
    res = fn(*args)
    ru1, (busy1, total1), t1 = resource.getrusage(resource.RUSAGE_CHILDREN), _proc_stat(), time.monotonic()
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    res["cpu_cores"] = cpu / (t1 - t0)  # cores its processes kept busy, on average
    res["machine_busy"] = (busy1 - busy0) / (total1 - total0) if total1 > total0 else float("nan")
    return res


# ---------------------------------------------------------------------------------- profile
_PROFILED = """
import cProfile, os, runpy, sys, time
out, clock, target = sys.argv[1], sys.argv[2], sys.argv[3]
sys.argv = sys.argv[3:]
timer = {"wall": time.perf_counter, "cpu": time.thread_time}[clock]
prof = cProfile.Profile(timer)
hard_exit = os._exit
def exit_after_dump(code):  # a role that ends with os._exit still leaves its profile
    prof.disable()
    prof.dump_stats(out)
    hard_exit(code)
os._exit = exit_after_dump
prof.enable()
try:
    if target.endswith(".py"):
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
except SystemExit as exc:
    if exc.code not in (0, None):
        raise
finally:
    prof.disable()
    prof.dump_stats(out)
"""


def _profiled(out: Path, clock: str, target: str, *args: str) -> list[str]:
    """argv running ``target`` (a script or a module) under cProfile with the ``clock`` timer
    (``cpu``: this thread's CPU time, robust on a loaded machine; ``wall``: elapsed time)."""
    return [python(), "-c", _PROFILED, str(out), clock, target, *args]


def profile(a: argparse.Namespace, out: Path) -> None:
    """One plain run and one 1-worker flotilla worker under cProfile; prints the top functions."""
    import pstats

    import yaml

    out.mkdir(parents=True, exist_ok=True)
    plain_prof, worker_prof = out / "plain.prof", out / "worker.prof"
    plain = _profiled(
        plain_prof, a.profile_clock, __file__, "--child-plain", "--out", str(out / "plain.json")
    )
    subprocess.run([*plain, *_shared_args(a)], check=True, timeout=a.timeout_s)
    cfg_file, secret = out / "flotilla1.yaml", out / "secret"
    cfg_file.write_text(yaml.safe_dump(flotilla_config(a, 1)))
    coord = [python(), "-m", "flotilla.cli.main", "coordinator", str(cfg_file), "--secret-file", str(secret)]
    with open(out / "coordinator.log", "w") as log, Children() as kids:
        overrides = [x for kv in a.set for x in ("--set", kv)]
        proc = subprocess.Popen([*coord, *overrides, "--report", str(out / "report")], stderr=log, stdout=log)
        kids.procs.append(proc)
        address = _wait_for_address(out / "coordinator.log", proc, a.timeout_s)
        worker = ["worker", "--coordinator", address, "--secret-file", str(secret), "--name", "w0"]
        worker += ["--log-level", "WARNING"]
        env = dict(os.environ)
        if a.threads:  # (the same intra-op threads as the plain loop: else cores / workers)
            env["FLOTILLA_TORCH_THREADS"] = str(a.threads)
        subprocess.run(
            _profiled(worker_prof, a.profile_clock, "flotilla.cli.main", *worker),
            check=True,
            timeout=a.timeout_s,
            env=env,
        )
    for name, prof in (("plain loop", plain_prof), ("flotilla worker (1 of 1)", worker_prof)):
        for key in ("cumulative", "tottime"):
            print(f"=== {name}: top functions by {key} ({a.profile_clock} time) ===")
            pstats.Stats(str(prof)).sort_stats(key).print_stats(30)
    print(f"profiles: {plain_prof} {worker_prof} (python -m pstats FILE)")


def _wait_for_address(log: Path, proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        for line in log.read_text().splitlines():
            if "coordinator listening on " in line:
                return line.split("coordinator listening on ", 1)[1].strip()
        time.sleep(0.05)
    raise SystemExit(f"coordinator did not start; see {log}")


# ---------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds of 300 steps (a couple of minutes)")
    ap.add_argument("--task", choices=sorted(TASKS), default="spirals")
    ap.add_argument("--rounds", type=int, default=None, help="default 7 (--quick: 3)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run, default 600 (--quick: 300)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where both contenders compute (cuda: the plain loop on cuda:0, every flotilla worker "
        "device: cuda; use --workers 1 on one GPU)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--steady-from",
        type=int,
        default=50,
        help="the steady-state ratio times steps K+1..N (default 50: the issue's steps 50-300)",
    )
    ap.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="both contenders: bf16 runs the forward pass and the loss under torch.autocast (job.precision)",
    )
    ap.add_argument("--workers", default="1,2", help="flotilla worker counts to run (1 is the ratio's)")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="intra-op threads of every contender's training process (the plain loop, each flotilla "
        "worker via FLOTILLA_TORCH_THREADS); 0: each one's default (torch's; flotilla's policy)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="flotilla config override (repeatable)",
    )
    ap.add_argument(
        "--against",
        default=None,
        metavar="SRC",
        help="another tree's src/ directory: adds contender against1 (1 worker from it) and prints "
        "before_after= (flotilla1 / against1)",
    )
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--profile", type=Path, default=None, help="profile one run of each under cProfile")
    ap.add_argument("--profile-clock", choices=("cpu", "wall"), default="cpu", help="cProfile's timer")
    ap.add_argument("--child-plain", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.rounds = a.rounds or (3 if a.quick else 7)
    a.steps = a.steps or (300 if a.quick else 600)
    a.worker_counts = sorted({int(w) for w in a.workers.split(",")} | {1})
    if a.against is not None:
        src = Path(a.against).resolve()
        if not (src / "flotilla" / "cli" / "main.py").is_file():
            ap.error(f"--against {a.against}: no flotilla/cli/main.py there (give the tree's src/ directory)")
        a.against = str(src)
    return a


def _row(name: str, r: dict[str, Any]) -> str:
    startup = "-" if r.get("startup_s") is None else f"{r['startup_s']:.2f}"
    extra = f"  threads {r['threads']}" if "threads" in r else ""
    if "mean_step_s" in r:
        extra = (
            f"  step {1e3 * r['mean_step_s']:.2f} ms (compute {1e3 * r['mean_compute_s']:.2f}), "
            f"between steps {1e3 * r['mean_between_steps_s']:.2f} ms"
        )
    if "p90_step_s" in r:
        extra += (
            f"  p90 {1e3 * r['p90_step_s']:.2f} ms, max {1e3 * r['max_step_s']:.1f} ms, "
            f"{1e3 * r['beyond_2x_median_s']:.0f} ms beyond 2x median"
        )
    return (
        f"  {name:10s} train {r['train_s']:.3f} s (median step {1e3 * r['median_step_s']:.2f} ms)  "
        f"start-up {startup} s  wall {r['wall_s']:.2f} s  "
        f"cpu {r['cpu_cores']:.2f} cores  machine busy {100 * r['machine_busy']:.0f}%  "
        f"loss {r['last_loss']:.4f}{extra}"
    )


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.child_plain:
        plain_child(a)
        return
    if a.profile is not None:
        profile(a, a.profile)
        return
    t_start = time.monotonic()
    # (against1 right after flotilla1: the two compared run next to each other in every round)
    more = [f"flotilla{n}" for n in a.worker_counts if n != 1]
    names = ["plain", "flotilla1", *(["against1"] if a.against else []), *more]
    print(
        f"task {a.task}, {a.steps} steps of batch {a.batch}, seed {a.seed}; contenders {names}; "
        f"{a.rounds} rounds, order alternating; machine: {machine_info()}",
        flush=True,
    )
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names[1:]}
    step_ratios: dict[str, list[float]] = {n: [] for n in names[1:]}
    steady_ratios: dict[str, list[float]] = {n: [] for n in names[1:]}
    before_after: list[float] = []
    added_ms: list[float] = []  # flotilla1's training time minus plain's, per step (ms)
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        for r, order in enumerate(alternating_orders(names, a.rounds)):
            work = Path(tmp) / f"round{r}"
            work.mkdir()
            got: dict[str, dict[str, Any]] = {}
            for name in order:
                if name == "plain":
                    got[name] = measured(run_plain, a, work)
                elif name == "against1":
                    got[name] = measured(run_flotilla, a, work, 1, a.against)
                else:
                    got[name] = measured(run_flotilla, a, work, int(name.removeprefix("flotilla")))
                runs[name].append(got[name])
            print(f"round {r} ({' -> '.join(order)}):")
            for name in names:
                print(_row(name, got[name]))
            for name in ratios:
                ratios[name].append(got[name]["train_s"] / got["plain"]["train_s"])
                step_ratios[name].append(got[name]["median_step_s"] / got["plain"]["median_step_s"])
                steady_ratios[name].append(got[name]["steady_s"] / got["plain"]["steady_s"])
            added_ms.append(1e3 * (got["flotilla1"]["train_s"] - got["plain"]["train_s"]) / a.steps)
            print(f"  flotilla1 adds {added_ms[-1]:.3f} ms per step over plain")
            if a.against:
                before_after.append(got["flotilla1"]["train_s"] / got["against1"]["train_s"])
                print(f"  flotilla1 / against1 {before_after[-1]:.3f}")
            print(
                "  ratios "
                + "  ".join(f"{n} {v[-1]:.3f}" for n, v in ratios.items())
                + "  (median step: "
                + "  ".join(f"{n} {v[-1]:.3f}" for n, v in step_ratios.items())
                + ")  (steady, after step "
                + f"{a.steady_from}: "
                + "  ".join(f"{n} {v[-1]:.3f}" for n, v in steady_ratios.items())
                + ")",
                flush=True,
            )
    med_ratio = {n: median(v) for n, v in ratios.items()}
    startups = {n: [x["startup_s"] for x in runs[n] if x.get("startup_s") is not None] for n in names}
    starts = ", ".join(f"{n} {median(v):.2f} s" for n, v in startups.items() if v)
    print(f"median start-up (process start -> first step): {starts}")
    print(
        "median cpu cores busy: "
        + ", ".join(f"{n} {median([x['cpu_cores'] for x in runs[n]]):.2f}" for n in names)
    )
    med_step = {n: median(v) for n, v in step_ratios.items()}
    med_steady = {n: median(v) for n, v in steady_ratios.items()}
    print(
        f"median steady-state ratio (the time of steps {a.steady_from + 1}..{a.steps}, per round): "
        + ", ".join(f"{n} {v:.3f} {[round(x, 3) for x in steady_ratios[n]]}" for n, v in med_steady.items())
    )
    print(
        "median over rounds of the median step time ratio (robust to bursts of load): "
        + ", ".join(f"{n} {v:.3f}" for n, v in med_step.items())
    )
    print(
        "median training-time ratio vs plain (per-round ratios; flotilla1's is ratio= without --against): "
        + ", ".join(f"{n} {v:.3f}" for n, v in med_ratio.items())
    )
    print(
        f"ms per step flotilla1 adds over plain ({a.device}, {a.precision}; the CPU proxy's goal <= 2 ms): "
        f"median {median(added_ms):.3f}, per round {[round(x, 3) for x in added_ms]}"
    )
    if a.against:
        print(f"flotilla1 / against1 per round: {[round(x, 3) for x in before_after]}")
    report_medians(
        a,
        t_start,
        "train_s",
        {n: median([x["train_s"] for x in runs[n]]) for n in names},
        {n: [x["train_s"] for x in runs[n]] for n in names},
        median(before_after) if a.against else med_ratio["flotilla1"],
        digits=3,
        ratio_name="before_after" if a.against else "ratio",
        extra={
            "runs": runs,
            "ratios": ratios,
            "median_ratios": med_ratio,
            "step_ratios": step_ratios,
            "median_step_ratios": med_step,
            "steady_ratios": steady_ratios,
            "median_steady_ratios": med_steady,
            "startups_s": startups,
            "before_after": before_after,
            "added_ms_per_step": added_ms,
            "device": a.device,
        },
    )


if __name__ == "__main__":
    main()
