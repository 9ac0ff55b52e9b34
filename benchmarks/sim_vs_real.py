"""The simulator against real runs: predicted and measured throughput per strategy (issue 35 item 5).

For each contender, in one invocation and alternating between rounds: a real ``flotilla run
examples/partial_reduce.yaml`` with the strategy and the cluster overridden (4 workers emulated
slower than the host, ``--steps`` steps), and ``flotilla simulate`` of the same configuration with
this machine's calibrated links (``flotilla calibrate``, once at the start) and the step it measures
(the job's task and model at the per-worker batch, on this machine).

- measured: rank 0's committed steps per second over its records after the first 10 % of the
  steps (the start-up is not a rate);
- predicted: the simulation's steps per second (its steps over its simulated time, from the first
  step);
- printed per contender: both, their ratio and ``|predicted / measured - 1|``; the CPU busy of the
  real runs (the devices are emulated slower than the host: the cores must not be saturated);
  with revocations, the median recovery measured (the run's summary:
  ``report/membership.recovery_summary``) and predicted (``SimResult.recoveries_s``).

Contenders: ``allreduce`` and ``diloco`` (H = 10) on an even cluster (4 x speed 0.25);
``partial_reduce`` (DPR, P = 3), ``adpsgd`` and ``ps_ssp`` (SSP(3)) with one worker 3x slower
(speeds 0.25, 0.25, 0.25, 0.083); ``pipeline_gpipe`` and ``pipeline_1f1b``:
``examples/pipeline_lm.yaml`` (2 stages of speeds 0.5 and 0.25, 8 microbatches; measured: its
last stage's steps); ``hetpipe``: ``examples/hetpipe.yaml``'s eight devices, speeds x 0.2,
``placement: ed``, ``s_local 0`` (measured: the first VW's last stage's steps); ``adaptive``:
``examples/adaptive.yaml``, every speed x 0.5, its 900 steps whatever ``--steps`` says (3 workers at 0.125,
two more added at step 40: the policy switches from all-reduce to AD-PSGD once they are up, and
back after both are killed at step 500; the membership changes, the start-ups and the switches
are in the rate); ``allreduce_link`` and ``pipeline_link``: ``allreduce`` and GPipe as above over
emulated links (``cluster.links.emulate``: 0.5 and 0.2 Gbit/s, 2 ms; the simulator takes them for
the job's links); ``spot``: ``examples/spot.yaml`` (6 workers under the AWS p3 spot trace at 300
trace seconds per second, every speed x 0.15: its revocations' recoveries and joins are in the
rate); ``allreduce_stop``: ``allreduce`` as above, 600 steps, w1 stopped (SIGSTOP) for 3 s at step
150 and w2 for 2 s at step 400 (each left behind and back as a newcomer).  Speed checks
(the simulator alone): 1,024 devices x 1,000 steps under ``allreduce`` and under ``ps`` SSP(3),
10,000 devices x 100 steps of ``allreduce`` under the AWS p3 trace mapped onto groups of devices.

Last line: ``ratio=<median over contenders of |predicted / measured - 1|>``.

    python benchmarks/sim_vs_real.py --quick          # 1 round, 150 steps
    python benchmarks/sim_vs_real.py --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import alternating_orders, cpu_busy, cpu_jiffies, machine_info, median, python, write_json

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "partial_reduce.yaml"
PIPELINE_CONFIG = ROOT / "examples" / "pipeline_lm.yaml"
HETPIPE_CONFIG = ROOT / "examples" / "hetpipe.yaml"
ADAPTIVE_CONFIG = ROOT / "examples" / "adaptive.yaml"
SPOT_CONFIG = ROOT / "examples" / "spot.yaml"
EVEN = [0.25] * 4
STRAGGLER = [0.25, 0.25, 0.25, 0.25 / 3]
STAGES = [0.5, 0.25]  # (pipeline_lm's two stages, slower than the host: 2 cores, 2 processes)


def _pipeline(schedule: str) -> str:
    return f"{{kind: pipeline, schedule: {schedule}, num_stages: 2, num_microbatches: 8}}"


# name -> (config, strategy, worker speeds, the kind flotilla simulate is asked for)
CONTENDERS: dict[str, tuple[Path, str, list[float], str]] = {
    "allreduce": (CONFIG, "{kind: allreduce}", EVEN, "allreduce"),
    "diloco": (CONFIG, "{kind: diloco, inner_steps: 10, outer_lr: 0.7, outer_momentum: 0.9}", EVEN, "diloco"),
    "partial_reduce": (
        CONFIG,
        "{kind: partial_reduce, group_size: 3, weighting: dynamic}",
        STRAGGLER,
        "partial_reduce",
    ),  # fmt: skip
    "adpsgd": (CONFIG, "{kind: adpsgd}", STRAGGLER, "adpsgd"),
    "ps_ssp": (CONFIG, "{kind: ps, consistency: {kind: ssp, staleness: 3}}", STRAGGLER, "ps"),
    "pipeline_gpipe": (PIPELINE_CONFIG, _pipeline("gpipe"), STAGES, "pipeline"),
    "pipeline_1f1b": (PIPELINE_CONFIG, _pipeline("1f1b"), STAGES, "pipeline"),
    # the example's eight devices (its speeds x 0.2: 0.9 of a core in all), placed by the planner
    "hetpipe": (HETPIPE_CONFIG, "{kind: hetpipe, placement: ed, s_local: 0}", [], "hetpipe"),
    # the example with every speed x 0.5 (five processes on 2 cores: 0.625 of a core at its
    # peak): 3 workers, two more from step 40 (the policy switches to AD-PSGD once they are
    # up), both killed at step 500 (and back to all-reduce), 900 steps
    "adaptive": (ADAPTIVE_CONFIG, "", [], "adaptive"),
    # the first two over emulated links (cluster.links.emulate): the step waits on its links
    "allreduce_link": (CONFIG, "{kind: allreduce}", EVEN, "allreduce"),
    "pipeline_link": (PIPELINE_CONFIG, _pipeline("gpipe"), STAGES, "pipeline"),
    # examples/spot.yaml: 6 workers under the AWS p3 spot trace (its revocations and additions,
    # 300 trace seconds per second), every speed x 0.15: the recoveries are in the rate
    "spot": (SPOT_CONFIG, "", [], "allreduce"),
    # allreduce as above, two workers stopped (SIGSTOP) for 3 s and 2 s, at steps 150 and 400
    "allreduce_stop": (CONFIG, "{kind: allreduce}", EVEN, "allreduce"),
}
# extra settings of a contender: its emulated links (comm/shaping.py; the simulator takes them
# for the job's links instead of the calibrated loopback's)
STOPS = (
    "{events: [{at_step: 150, action: stop, worker: w1, duration_s: 3}, "
    "{at_step: 400, action: stop, worker: w2, duration_s: 2}]}"
)
EXTRA = {
    "allreduce_stop": [f"cluster.revocations={STOPS}"],
    "allreduce_link": [
        "cluster.links.emulate=true",
        "cluster.links.bandwidth_gbps=0.5",
        "cluster.links.latency_s=0.002",
    ],
    "pipeline_link": [
        "cluster.links.emulate=true",
        "cluster.links.bandwidth_gbps=0.2",
        "cluster.links.latency_s=0.002",
    ],
}
# the config's own devices (no speeds above), every speed times this
SCALE = {"hetpipe": 0.2, "adaptive": 0.5, "spot": 0.15}
# steps whatever --steps says: the example's own (its joiners are up and the policy switches
# only after a few seconds of start-up; 150 steps of all-reduce end before that)
STEPS = {
    "adaptive": 900,
    "spot": 800,
    "allreduce_stop": 600,
}  # (spot: the trace's first removals come 7-11 s in)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--only", default="", help="comma-separated contenders")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.steps = a.steps or (150 if a.quick else 300)
    return a


def sets(name: str, steps: int) -> list[str]:
    _, strategy, speeds, _ = CONTENDERS[name]
    memory = ", memory_bytes: 256MiB" if strategy.startswith("{kind: pipeline") else ""
    workers = ", ".join(f"{{name: w{i}, speed: {s:.6f}{memory}}}" for i, s in enumerate(speeds))
    out = ["--set", f"strategy={strategy}"] if strategy else []  # ("": the config's own)
    if speeds:
        out += ["--set", f"cluster.workers=[{workers}]"]
    elif SCALE[name] != 1.0:  # (the config's own devices, every speed scaled)
        out += _scaled(CONTENDERS[name][0], SCALE[name])
    for extra in EXTRA.get(name, []):
        out += ["--set", extra]
    return out + [
        "--set", f"job.steps={STEPS.get(name, steps)}", "--set", "job.epochs=null",
        "--set", "job.eval_every_steps=0",
    ]  # fmt: skip


def _scaled(config: Path, scale: float) -> list[str]:
    """``--set`` options giving ``config``'s workers, and its default speed (a worker without one,
    a joiner of its revocation events), every speed times ``scale``."""
    import yaml

    cluster = yaml.safe_load(config.read_text())["cluster"]
    default = float(cluster.get("defaults", {}).get("speed", 1.0))
    out = ["--set", f"cluster.defaults.speed={default * scale:.6f}"]
    if "workers" not in cluster:  # (num_workers copies of the defaults)
        return out
    workers = [{**w, "speed": round(float(w.get("speed", default)) * scale, 6)} for w in cluster["workers"]]
    return ["--set", f"cluster.workers={json.dumps(workers)}", *out]


def processes(name: str) -> int:
    """The devices a contender's real run places on this machine (HetPipe: every device of the
    cluster, though its placement may leave some unused)."""
    speeds = CONTENDERS[name][2]
    if speeds:
        return len(speeds)
    import yaml

    cluster = yaml.safe_load(CONTENDERS[name][0].read_text())["cluster"]
    return len(cluster["workers"]) if "workers" in cluster else int(cluster["num_workers"])


def calibrate(world_size: int, tmp: Path) -> Path:
    out = tmp / f"calibration-{world_size}.json"
    cal = [python(), "-m", "flotilla.cli.main", "calibrate", "--out", str(out), "--repeats", "30"]
    done = subprocess.run(
        [*cal, "--world-size", str(world_size)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise SystemExit(f"calibrate --world-size {world_size} failed:\n{done.stderr[-2000:]}")
    print(done.stdout.strip().splitlines()[-1], flush=True)
    return out


def measured_rate(report: Path, steps: int) -> float:
    """Rank 0's committed steps per second after the first 10 % of the steps (a pipeline: its
    last stage's steps)."""
    recs = [json.loads(line) for line in (report / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last_stage = max((int(r["stage_idx"]) for r in recs if "stage_idx" in r), default=None)
    mine = sorted(
        (r["step"], r["time_s"])
        for r in recs
        if r.get("kind") != "eval"
        and "step" in r
        and r.get("replica", 0) == 0  # (independent instances -- HetPipe's VWs -- : the first one's)
        and (
            r.get("stage_idx") == last_stage
            if last_stage is not None
            else r.get("committed") and r.get("rank") == 0
        )
    )
    mine = [(s, t) for s, t in mine if s >= steps // 10]
    if len(mine) < 2 or mine[-1][1] <= mine[0][1]:
        raise SystemExit(f"{report}: too few rank-0 step records to measure a rate")
    return (mine[-1][0] - mine[0][0]) / (mine[-1][1] - mine[0][1])


def measured_parts(report: Path, steps: int) -> dict[str, float]:
    """Where a step's time went in the real run, medians over the records after the first 10 % of
    the steps (milliseconds): per rank (a pipeline: per stage) its raw ``compute``, its emulated
    ``device`` time (compute plus the emulator's sleep), the ``unit`` (``step_s``: compute, sleep
    and synchronisation) and the ``period`` between its records (everything: the loop, data,
    records).  Keys ``<who>.<part>_ms``."""
    recs = [json.loads(line) for line in (report / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        if r.get("kind") == "eval" or "step" not in r or r.get("replica", 0) != 0 or r["step"] < steps // 10:
            continue
        who = f"stage{r['stage_idx']}" if "stage_idx" in r else f"rank{r.get('rank', '?')}"
        if "stage_idx" in r or r.get("committed"):
            by.setdefault(who, []).append(r)
    out: dict[str, float] = {}
    for who, rs in sorted(by.items()):
        rs.sort(key=lambda r: (r["step"], r["time_s"]))
        gaps = [(b["time_s"] - a["time_s"]) / max(1, b["step"] - a["step"]) for a, b in zip(rs, rs[1:])]
        timed = [r for r in rs if "compute_s" in r]  # (a stage's records have no per-step compute)
        parts = {
            "compute": [float(r["compute_s"]) for r in timed],
            "device": [float(r["compute_s"]) + float(r.get("emulated_s", 0.0)) for r in timed],
            "unit": [float(r["step_s"]) for r in rs if "step_s" in r],
            "period": [g for g in gaps if g > 0],
        }
        out |= {f"{who}.{k}_ms": 1000 * median(v) for k, v in parts.items() if v}
    return out


def real(name: str, steps: int, tmp: Path) -> dict[str, Any]:
    report = tmp / f"real-{name}-{time.monotonic_ns()}"
    config = CONTENDERS[name][0]
    cmd = [python(), "-m", "flotilla.cli.main", "run", str(config), "--no-progress", "--report", str(report)]
    cmd += ["--run-dir", str(report / "run"), *sets(name, steps)]
    jiffies = cpu_jiffies()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    busy = cpu_busy(jiffies)
    if out.returncode != 0:
        raise SystemExit(f"{name}: the real run failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    steps = STEPS.get(name, steps)
    parts = measured_parts(report, steps)
    revs = json.loads((report / "summary.json").read_text()).get("revocations") or {}
    return {"steps_per_s": measured_rate(report, steps), "cpu_busy": busy, "parts": parts} | {
        "recovery_p50_s": revs.get("recovery_p50_s"),
        "recovered": revs.get("recovered", 0),
    }


def simulated(name: str, steps: int, calibration: Path, tmp: Path) -> dict[str, Any]:
    out_json = tmp / f"sim-{name}-{time.monotonic_ns()}.json"
    config, _, _, kind = CONTENDERS[name]
    cmd = [python(), "-m", "flotilla.cli.main", "simulate", str(config), *sets(name, steps)]
    cmd += ["--calibration", str(calibration), "--strategies", kind, "--json", str(out_json)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{name}: the simulation failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    body = json.loads(out_json.read_text())
    row = body["rows"][0]
    step_s = float(body["job"]["step_s"])
    devices = {f"{c['type']}@{c['speed']:.3g}": 1000 * step_s / c["speed"] for c in body.get("classes", [])}
    parts = {k.replace("_s", "_ms"): 1000 * v for k, v in row.get("parts", {}).items()}
    return {"steps_per_s": row["steps_per_s"], "step_s": step_s, "completed": row["completed"]} | {
        "devices": devices,
        "parts": parts,
        "recovery_p50_s": row.get("recovery_p50_s"),
        "recoveries": row.get("recoveries", 0),
    }


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"


def _parts_line(parts: dict[str, float]) -> str:
    """``rank0: compute 1.2 device 4.8 unit 9.1 period 10.3; rank1: ...``"""
    whos: dict[str, list[str]] = {}
    for key, v in parts.items():
        who, _, part = key.rpartition(".")
        whos.setdefault(who or "instance", []).append(f"{part.removesuffix('_ms')} {v:.2f}")
    return "; ".join(f"{who}: {' '.join(items)}" for who, items in whos.items())


def speed_checks() -> dict[str, float]:
    """Seconds the simulator takes for the sizes of the module doc."""
    from flotilla.cluster.revocation_trace import parse_trace
    from flotilla.ps.consistency import SSP
    from flotilla.sim.model import DeviceClass, SimCluster, SimJob
    from flotilla.sim.ps import PSSpec
    from flotilla.sim.trace import trace_changes
    from flotilla.sim.vote import VoteSpec

    def timed(fn: Any) -> float:
        t0 = time.perf_counter()
        result = fn()
        assert result.completed, result
        return time.perf_counter() - t0

    classes = (
        DeviceClass(type="a", count=512, per_node=8),
        DeviceClass(type="b", count=512, speed=0.5, per_node=8),
    )
    cluster = SimCluster(classes=classes)
    job = SimJob(steps=1000, step_s=0.1, model_bytes=100_000_000)
    out = {
        "allreduce_1024x1000_s": timed(lambda: VoteSpec().simulate(job, cluster)),
        "ps_ssp_1024x1000_s": timed(lambda: PSSpec(consistency=SSP(staleness=3)).simulate(job, cluster)),
    }
    big = SimCluster(classes=(DeviceClass(type="a", count=10_000, per_node=8),))
    events = parse_trace(
        (ROOT / "examples" / "traces" / "aws-p3-spot.csv").read_text(), source="aws-p3-spot.csv"
    )
    changes, _ = trace_changes(big, events, time_scale=60.0)
    job100 = SimJob(steps=100, step_s=0.5, model_bytes=100_000_000)
    out["allreduce_10000x100_trace_s"] = timed(lambda: VoteSpec().simulate(job100, big, changes=changes))
    return out


def main() -> None:
    a = parse_args()
    names = [n.strip() for n in a.only.split(",") if n.strip()] or list(CONTENDERS)
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown:
        raise SystemExit(f"--only: unknown {unknown}; choose from {sorted(CONTENDERS)}")
    t_start = time.monotonic()
    cells: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="sim-vs-real-") as tmp_s:
        tmp = Path(tmp_s)
        calibrations = {n: calibrate(n, tmp) for n in sorted({processes(name) for name in names})}
        for r in range(a.rounds):
            for name in alternating_orders(names, a.rounds)[r]:
                meas = real(name, a.steps, tmp)
                pred = simulated(name, a.steps, calibrations[processes(name)], tmp)
                cell = {
                    "measured": meas["steps_per_s"],
                    "predicted": pred["steps_per_s"],
                    "cpu_busy": meas["cpu_busy"],
                    "step_s": pred["step_s"],
                    "measured_parts": meas["parts"],
                    "predicted_device_ms": pred["devices"],
                    "predicted_parts": pred["parts"],
                    "measured_recovery_p50_s": meas["recovery_p50_s"],
                    "predicted_recovery_p50_s": pred["recovery_p50_s"],
                }
                cells[name].append(cell)
                print(
                    f"round {r} {name:15s} measured {cell['measured']:7.3f} steps/s  predicted "
                    f"{cell['predicted']:7.3f}  ratio {cell['predicted'] / cell['measured']:6.3f}  "
                    f"cpu {100 * cell['cpu_busy']:.0f}%  (sim step {1000 * cell['step_s']:.1f} ms)",
                    flush=True,
                )
                print(f"  {name} measured (ms): " + _parts_line(meas["parts"]), flush=True)
                print(
                    f"  {name} predicted (ms): period {1000 / cell['predicted']:.2f}; one step's device time "
                    + ", ".join(f"{k} {v:.2f}" for k, v in pred["devices"].items())
                    + (f"; {_parts_line(pred['parts'])}" if pred["parts"] else ""),
                    flush=True,
                )
                if meas["recovery_p50_s"] is not None or pred["recovery_p50_s"] is not None:
                    print(
                        f"  {name} recovery p50: measured {_secs(meas['recovery_p50_s'])} "
                        f"({meas['recovered']} recovered), predicted {_secs(pred['recovery_p50_s'])} "
                        f"({pred['recoveries']} recoveries)",
                        flush=True,
                    )
    print(f"machine: {machine_info()}; wall {time.monotonic() - t_start:.1f} s; {a.steps} steps per run")
    errors = {}
    print(f"{'contender':15s} {'measured':>9s} {'predicted':>9s} {'pred/meas':>9s} {'|err|':>7s} {'cpu':>5s}")
    for name, runs in cells.items():
        m = median([c["measured"] for c in runs])
        p = median([c["predicted"] for c in runs])
        errors[name] = abs(p / m - 1)
        cpu = median([c["cpu_busy"] for c in runs])
        print(f"{name:15s} {m:9.3f} {p:9.3f} {p / m:9.3f} {errors[name]:7.3f} {100 * cpu:4.0f}%")
    measured_order = sorted(cells, key=lambda n: -median([c["measured"] for c in cells[n]]))
    predicted_order = sorted(cells, key=lambda n: -median([c["predicted"] for c in cells[n]]))
    print(f"order, measured fastest first: {measured_order}; predicted: {predicted_order}")
    speed = speed_checks()
    for k, v in speed.items():
        print(f"speed check {k}: {v:.2f} s")
    ratio = median(list(errors.values()))
    if a.json:
        body = {"cells": cells, "errors": errors, "speed": speed, "ratio": ratio}
        body |= {"measured_order": measured_order, "predicted_order": predicted_order}
        body |= {"machine": machine_info(), "args": {k: str(v) for k, v in vars(a).items()}}
        write_json(a.json, body)
    print(f"ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
