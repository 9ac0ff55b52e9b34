"""Benchmark: the cost of chain replication (``strategy.replication: 2``) on parameter-server
throughput.

Two sets of shard processes run side by side (started afresh for each model size), started
exactly as ``flotilla run`` starts them:

- ``plain``: ``--shards`` ``flotilla server`` processes (``cli/ps_cmd.py``, replication 1);
- ``replicated``: per shard a backup and a primary (``cli/ps_replica_cmd.py``): the primary
  forwards every accepted request to its backup and answers only once the backup holds it.

A client process's ``--workers`` threads, one :class:`flotilla.ps.client.PSClient` each (a worker
id each, ASP so that no pull waits for another worker), call ``push_pull`` -- push M bytes of
gradients, pull M bytes of weights, the servers applying SGD with momentum -- ``--iters`` times
each; the figure is pushes per second over all workers.  Each round measures both contenders, the
order alternating between rounds; a contender's figure is its median over rounds.  Printed per
model size M, with ``ratio_push_pull=<replicated / plain>`` (the geometric mean of the per-size
ratios): the worst case, a worker that does nothing but talk to the servers.

Then the same in training: ``flotilla run examples/ps_ssp.yaml`` (4 workers, 2 shards; without its
straggler, ``--epochs`` epochs) with ``strategy.replication`` 1 and 2, alternating, the job's
samples/s from its summary; median over rounds.  Last line: ``ratio=<replicated / plain>``
training samples/s (goal >= 0.8).

Run: ``python benchmarks/ps_replication.py --quick`` (about a minute) or without ``--quick``;
``--json PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

MB = 2**20
QUICK = {"sizes_mb": [0.25, 2.0], "rounds": 5, "iters": 20, "job_rounds": 3, "epochs": 1}
FULL = {"sizes_mb": [0.25, 1.0, 4.0], "rounds": 11, "iters": 40, "job_rounds": 5, "epochs": 2}
ROOT = Path(__file__).resolve().parents[1]
NO_STRAGGLER = "cluster.workers=[{name: w0}, {name: w1}, {name: w2}, {name: w3}]"
CONFIG = """
cluster: {{num_workers: {workers}}}
job:
  model: {{name: tiny_mlp}}
  dataset: {{name: synthetic, num_samples: 100}}
  optimizer: {{kind: sgd, lr: 0.001, momentum: 0.9}}
  batch_size: 8
  steps: 10
strategy: {{kind: ps, consistency: asp, num_servers: {shards}, update: server_sgd}}
"""


def _await_file(path: Path, proc: Any, timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{path.name}: the server did not start (exit code {proc.poll()})")
        time.sleep(0.05)
    return path.read_text().strip()


def _start(kids: _common.Children, argv: list[str]) -> Any:
    """A shard process, its stdout (the address it prints) discarded: it is read from its file."""
    import subprocess

    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    kids.procs.append(proc)
    return proc


def start_shards(kids: _common.Children, tmp: Path, shards: int, replicated: bool) -> list[str]:
    """The shard processes of one contender; their (primaries') addresses."""
    cfg, secret = tmp / "job.yaml", tmp / "secret"
    common = ["--secret-file", str(secret), "--log-level", "WARNING"]
    addresses = []
    for i in range(shards):
        tag = f"{'r' if replicated else 'p'}{i}"
        if not replicated:
            argv = ["-m", "flotilla.cli.ps_cmd", str(cfg), "--shard-index", str(i), *common]
            proc = _start(kids, [_common.python(), *argv, "--address-file", str(tmp / f"{tag}.addr")])
            addresses.append(_await_file(tmp / f"{tag}.addr", proc))
            continue
        base = [_common.python(), "-m", "flotilla.cli.ps_replica_cmd", str(cfg), "--shard-index", str(i)]
        backup = _start(
            kids, [*base, *common, "--role", "backup", "--address-file", str(tmp / f"{tag}b.addr")]
        )
        backup_address = _await_file(tmp / f"{tag}b.addr", backup)
        primary = _start(
            kids,
            [*base, *common, "--role", "primary", "--backup", backup_address]
            + ["--address-file", str(tmp / f"{tag}.addr")],
        )
        addresses.append(_await_file(tmp / f"{tag}.addr", primary))
    return addresses


class Contender:
    """``workers`` clients of one set of shards, each with its own clock."""

    def __init__(self, addresses: list[str], secret: bytes, workers: int, mb: float) -> None:
        import torch

        from flotilla.ps.client import ClientOptions, PSClient, keys_of

        n = max(1, int(mb * MB / 4 / 4))
        self.values = [{f"p{k}": torch.randn(n) * 1e-3 for k in range(4)} for _ in range(workers)]
        self.outs = [{k: torch.empty_like(v) for k, v in vals.items()} for vals in self.values]
        opts = ClientOptions(pull_timeout_s=120.0)
        keys = keys_of(self.values[0])
        self.clients = [
            PSClient(addresses, secret, worker_id=w, keys=keys, options=opts) for w in range(workers)
        ]
        for c in self.clients:
            c.hello(0)
        for c, vals in zip(self.clients, self.values):
            c.initialize(vals)
        self.clocks = [0] * workers

    def run(self, iters: int) -> float:
        """Pushes per second of ``iters`` push_pulls by every worker at once."""

        def work(w: int) -> None:
            c, vals, out = self.clients[w], self.values[w], self.outs[w]
            for _ in range(iters):
                c.push_pull(vals, self.clocks[w], out)
                self.clocks[w] += 1

        threads = [threading.Thread(target=work, args=(w,)) for w in range(len(self.clients))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return len(threads) * iters / (time.perf_counter() - t0)

    def close(self) -> None:
        for c in self.clients:
            c.close()


def job_samples_per_s(tmp: Path, replication: int, epochs: int, tag: str) -> float:
    """One ``flotilla run`` of ``examples/ps_ssp.yaml``: its training samples/s (summary)."""
    import json
    import subprocess

    report = tmp / f"report-{tag}"
    argv = [_common.python(), "-m", "flotilla.cli.main", "run", str(ROOT / "examples" / "ps_ssp.yaml")]
    argv += ["--report", str(report), "--run-dir", str(tmp / f"run-{tag}"), "--no-progress"]
    for s in (NO_STRAGGLER, f"job.epochs={epochs}", f"strategy.replication={replication}"):
        argv += ["--set", s]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    summary = json.loads((report / "summary.json").read_text())
    if not summary["completed"] or summary.get("updates_lost"):
        raise RuntimeError(f"run {tag} did not complete cleanly: {summary.get('error')}")
    return float(summary["samples_per_s"])


def job_rounds(tmp: Path, plan: dict[str, Any]) -> dict[str, list[float]]:
    runs: dict[str, list[float]] = {"plain": [], "replicated": []}
    for r, order in enumerate(_common.alternating_orders(list(runs), plan["job_rounds"])):
        for name in order:
            rate = job_samples_per_s(tmp, 2 if name == "replicated" else 1, plan["epochs"], f"{name}{r}")
            runs[name].append(rate)
            print(f"job round {r}: {name} {rate:.1f} samples/s", flush=True)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    plan = QUICK if a.quick else FULL
    t_start = time.monotonic()
    from flotilla.comm.auth import generate_secret, write_secret_file
    from flotilla.core.threads import use_torch_threads

    use_torch_threads()
    with tempfile.TemporaryDirectory(prefix="flotilla-bench-repl-") as d, _common.Children() as kids:
        tmp = Path(d)
        secret = generate_secret()
        write_secret_file(tmp / "secret", secret)
        (tmp / "job.yaml").write_text(CONFIG.format(workers=a.workers, shards=a.shards))
        per_size: dict[str, Any] = {}
        cpu = _common.cpu_jiffies()
        for mb in plan["sizes_mb"]:  # fresh shards per size (a shard keeps its first layout)
            for f in tmp.glob("*.addr"):
                f.unlink()
            kids.stop_all()
            sets = {"plain": start_shards(kids, tmp, a.shards, False)}
            sets["replicated"] = start_shards(kids, tmp, a.shards, True)
            contenders = {name: Contender(addrs, secret, a.workers, mb) for name, addrs in sets.items()}
            runs: dict[str, list[float]] = {name: [] for name in contenders}
            for name in contenders:  # warm-up (connections, first allocations): not measured
                contenders[name].run(2)
            for order in _common.alternating_orders(list(contenders), plan["rounds"]):
                for name in order:
                    runs[name].append(contenders[name].run(plan["iters"]))
            for c in contenders.values():
                c.close()
            med = {name: _common.median(v) for name, v in runs.items()}
            per_size[str(mb)] = {"runs": runs, "median": med, "ratio": med["replicated"] / med["plain"]}
            print(
                f"{mb:5.2f} MB: plain {med['plain']:7.1f} pushes/s, replicated {med['replicated']:7.1f} "
                f"pushes/s, ratio {per_size[str(mb)]['ratio']:.3f}"
            )
        busy = _common.cpu_busy(cpu)
        kids.stop_all()
        ratios = [v["ratio"] for v in per_size.values()]
        ratio_pp = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        print(f"cpu utilisation (all cores, while measuring push_pull): {busy:.0%}")
        print(f"ratio_push_pull={ratio_pp:.3f}  (replicated / plain pushes per second, geometric mean)")
        cpu = _common.cpu_jiffies()
        runs = job_rounds(tmp, plan)
        job_busy = _common.cpu_busy(cpu)
    medians = {name: _common.median(v) for name, v in runs.items()}
    print(f"cpu utilisation (all cores, during the training runs): {job_busy:.0%}")
    _common.report_medians(
        a,
        t_start,
        "samples_per_s",
        medians,
        runs,
        medians["replicated"] / medians["plain"],
        digits=1,
        extra={"push_pull": per_size, "ratio_push_pull": ratio_pp, "cpu_busy": [busy, job_busy]},
        ratio_note="replicated / plain training samples per second, examples/ps_ssp.yaml; goal >= 0.8",
    )


if __name__ == "__main__":
    main()
