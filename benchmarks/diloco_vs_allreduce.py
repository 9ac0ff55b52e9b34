"""Time to a target test accuracy over a slow link: ``diloco`` against ``allreduce``.

The job is ``examples/diloco.yaml`` (mnist1d, cnn1d, 4 workers, global batch 128); ``allreduce``
runs the same task with the same job optimizer (its ``--allreduce-optimizer``), ``diloco`` with
its inner Adam and Nesterov outer step every ``inner_steps``.  The link is slow for real: every
run is started inside a fresh network namespace whose loopback interface carries a ``tc netem``
rate limit (``--rate``, default 100mbit) and delay (``--delay``; where the kernel has no netem, a
``tc tbf`` token bucket with the rate only), so every byte any process of the
run sends -- gloo's all-reduce rings, the coordinator's messages -- goes through that one shaped
link (a shared medium: N workers share the rate, as on one slow uplink).  Needs root, ``ip`` and
``tc``; without them the benchmark says so and exits 2.

Devices are emulated SLOWER than the host (``--speed``, default 0.5) so the 2 cores are not
saturated; the CPU utilisation of every run is printed.  Within a round each contender runs once
(order alternating between rounds); the time to ``--target`` runs from the first training record
to the first evaluation at or above it (``benchmarks/_tta.py``).  Last line:
``ratio=<diloco / allreduce>`` (median over rounds; goal <= 0.5).

    sudo python benchmarks/diloco_vs_allreduce.py --quick       # one round
    sudo python benchmarks/diloco_vs_allreduce.py --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import alternating_orders, machine_info, median, python, write_json
from _tta import run_to_target

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "diloco.yaml"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _tc(ns: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, timeout=30)


class SlowLink:
    """A network namespace whose loopback is shaped: ``tc netem`` (rate and delay) where the
    kernel has it, else ``tc tbf`` (a token bucket: the rate only; ``qdisc`` says which)."""

    def __init__(self, rate: str, delay: str) -> None:
        self.name = f"fl-slow-{os.getpid()}"
        _ip("netns", "add", self.name)
        try:
            _ip("-n", self.name, "link", "set", "lo", "up")
            root = ("qdisc", "add", "dev", "lo", "root")
            self.qdisc = f"netem rate {rate} delay {delay}"
            if _tc(self.name, *root, "netem", "rate", rate, "delay", delay).returncode != 0:
                self.qdisc = f"tbf rate {rate} burst 64kb latency 400ms (no netem in this kernel: no delay)"
                done = _tc(self.name, *root, "tbf", "rate", rate, "burst", "64kb", "latency", "400ms")
                if done.returncode != 0:
                    raise RuntimeError(f"tc could not shape the link: {done.stderr.strip()}")
        except BaseException:
            self.close()
            raise

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    missing = [c for c in ("ip", "tc") if shutil.which(c) is None]
    return f"needs {' and '.join(missing)}" if missing else None


def _cmd(link: SlowLink, kind: str, report: Path, args: argparse.Namespace) -> list[str]:
    sets = {
        "cluster.defaults.speed": str(args.speed),
        "job.eval_every_steps": str(args.eval_every),
        "job.epochs": "30",  # (stopped at the target)
    }
    if kind == "allreduce":
        sets["strategy"] = "{kind: allreduce}"
        sets["job.optimizer"] = args.allreduce_optimizer
    else:
        sets["strategy.inner_steps"] = str(args.inner_steps)
    extra = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    return [*link.prefix(), python(), "-m", "flotilla.cli.main", "run", str(CONFIG), "--no-progress",
            "--report", str(report), *extra]  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", default="100mbit", help="tc netem rate of the shared link")
    p.add_argument("--delay", default="1ms", help="tc netem delay of the shared link")
    p.add_argument(
        "--speed", type=float, default=0.5, help="emulated device speed (< 1: slower than the host)"
    )
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--allreduce-optimizer", default="{kind: sgd, lr: 0.05, momentum: 0.9}")
    p.add_argument("--max-run-s", type=float, default=900.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    why = unavailable()
    if why is not None:
        print(f"diloco_vs_allreduce: {why}", file=sys.stderr)
        return 2
    rounds = 1 if args.quick else args.rounds
    times: dict[str, list[float | None]] = {"allreduce": [], "diloco": []}
    runs = []
    link = SlowLink(args.rate, args.delay)
    print(f"link: {link.qdisc}, shared by every process of a run; device speed {args.speed}", flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="flotilla-diloco-") as tmp:
            for r, order in enumerate(alternating_orders(list(times), rounds)):
                for kind in order:
                    report = Path(tmp) / f"{kind}-{r}"
                    res = run_to_target(
                        _cmd(link, kind, report, args), ROOT, report, args.target, args.max_run_s
                    )
                    times[kind].append(res["time_to_target_s"])
                    runs.append({"round": r, "kind": kind, **res})
                    t = res["time_to_target_s"]
                    print(f"round {r} {kind:9s} time to {args.target}: "
                          f"{'not reached' if t is None else f'{t:.1f} s'}  best {res['best_accuracy']:.3f}  "
                          f"cpu {res['cpu_busy']:.0%}", flush=True)  # fmt: skip
    finally:
        link.close()
    ratios = [d / a for d, a in zip(times["diloco"], times["allreduce"]) if d is not None and a is not None]
    out = {
        "machine": machine_info(),
        "link": link.qdisc,
        "speed": args.speed,
        "target": args.target,
        "runs": runs,
        "ratios": ratios,
        "ratio": median(ratios) if ratios else None,
    }
    if args.json is not None:
        write_json(args.json, out)
    for kind, ts in times.items():
        got = [t for t in ts if t is not None]
        print(f"{kind}: median time to {args.target} = {median(got):.1f} s over {len(got)} run(s)" if got
              else f"{kind}: target not reached")  # fmt: skip
    print(f"ratio={out['ratio']:.3f}" if ratios else "ratio=nan (a contender did not reach the target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
