"""Benchmark: flotilla's in-place recovery versus checkpoint-and-restart (torchrun), after K workers
of 6 are SIGKILLed at once (SPEC §7, Spotnik: "Baseline to beat: checkpoint-and-restart").

What is measured, alternating the two contenders kill by kill: each repetition kills K workers of
each contender for every K of ``--ks``, flotilla first in even repetitions and torchrun first in
odd ones, so a drift of the machine's load is spread over both.  Every flotilla kill is a fresh job;
consecutive torchrun kills in that order (at most ``--max-restarts``) share one torchrun job, the
next kill waiting until the restarted group is warm again (a restarted group is a fresh set of
processes, and this halves the baseline's share of the run time).

- ``flotilla``: a real ``flotilla run examples/tiny.yaml`` job (strategy ``allreduce``, ``--world``
  workers at emulated ``--speed``; started, warmed up and stopped with ``crash_recovery.py``'s
  machinery).  Once every worker committed ``--warmup-steps`` steps the script waits a random
  moment over a step and SIGKILLs K workers chosen at random, one ``kill`` after the other (a few
  microseconds apart).  Recovery of a survivor = kill -> its first committed step in a view of at
  most ``world - K`` workers (a step cannot commit in a view that still holds a dead worker), on
  the coordinator's clock as in ``crash_recovery.py``.
- ``torchrun``: ``python -m torch.distributed.run --nnodes 1 --nproc-per-node 6 --max-restarts 3
  --monitor-interval 0.1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:<free port>
  benchmarks/_torchrun_ddp.py``: plain DDP over gloo on the CPU training the same task (tiny_mlp
  on the synthetic blobs, batch 64 split over the ranks, SGD lr 0.1 momentum 0.9, seed 0, the
  same emulated speed; ``--check-task`` verifies the model, data and shards equal flotilla's;
  run by hand with 6 ranks, its per-rank losses of the first 6 steps equalled flotilla's to 6 decimals).
  Rank 0 checkpoints after every step (temporary file, fsync, rename, fsync of the directory);
  every (re)started rank resumes from the checkpoint.  Once every rank committed
  ``--warmup-steps`` steps, K rank processes (not the agent) are SIGKILLed at a random moment over
  a step; the agent sees a worker fail, stops the others, re-rendezvous and starts a new group,
  which imports torch, joins the gloo group, loads the checkpoint and goes on.  Recovery of a
  rank = kill -> its first step committed by the restarted group (``time.time()`` in the ranks'
  JSONL records and here).  Also printed: kill -> the new processes started, kill -> all ranks
  ready (group formed, checkpoint loaded).

Per kill: p50 and max over the survivors (flotilla) or over the restarted ranks (torchrun), steps
lost (the distinct steps whose work was thrown away and redone: flotilla's discarded steps after
the kill and any committed step committed again; torchrun's in-flight steps and every step
committed since the checkpoint it resumed from; with a checkpoint every step that is about 1 for
both), and the machine's CPU use (``/proc/stat``, all cores) over the job and over the recovery
window.  A kill after which the job has not recovered within ``--job-timeout-s`` (or whose agent
or launcher exited first) is a FAILURE, printed, counted at that bound, its logs kept, and makes
the exit code 1.  Per K: the medians over kills of the per-kill max (every survivor recovered) for
both and their ratio; with more than one K, flotilla's slope per extra simultaneous revocation,
``(median(K_max) - median(K_min)) / (K_max - K_min)`` in ms.  Last line:
``ratio=<flotilla median / torchrun median at K = 1>``.

What the baseline needed on this machine (torch 2.13, CPU): torchrun's c10d rendezvous shares the
agent's TCPStore with the workers by default, and a restarted group's gloo rendezvous then read the
previous group's addresses from it (every restart failed with ``Gloo connectFullMesh failed ...
Connection refused``; pytorch/pytorch#135712).  The baseline therefore runs with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (rank 0 of each group hosts a fresh store, the documented
opt-out); nothing else was changed (``--monitor-interval 0.1`` is torchrun's default, passed
explicitly).  The DDP script's backward emulation sleeps in a communication hook that then calls
the default ``allreduce_hook``.

Caveats: 6 processes of each contender share the 2 cores of the development machine (and other
tenants': see the loadavg and CPU columns), so torchrun's restart is dominated by 6 interpreters
importing torch at once; on a machine with a core per worker it would likely be shorter (the SPEC
quotes roughly 20 s from the Spotnik paper).  The task is tiny: writing and loading its checkpoint
cost almost nothing here; a real model makes the baseline slower, not faster.  Other tenants'
load moves both contenders' figures (flotilla's by tens of ms, torchrun's by seconds).
Clocks: flotilla's times are on its coordinator's clock, torchrun's on this machine's wall clock
(same host).  Only the survivors' (flotilla) or the restarted ranks' (torchrun) recovery is
measured; flotilla's replacement of the lost workers is not part of it.

    python benchmarks/recovery_vs_restart.py --quick     # K=1, 2 kills each: 75 s on an idle 2-core box
    python benchmarks/recovery_vs_restart.py --json runs/recovery_vs_restart.json  # K=1,2,3 x 4
    python benchmarks/recovery_vs_restart.py --check-task  # the DDP script's task == flotilla's
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import Children, cpu_busy, cpu_jiffies, machine_info, median, python, write_json  # noqa: E402
from crash_recovery import (  # noqa: E402
    digest_mismatches,
    period,
    processes_mentioning,
    run_t0_unix,
    split_votes,
    start_job,
    stop_job,
    training_records,
    wait_until,
    warmed_up,
)

CONTENDERS = ("flotilla", "torchrun")
DDP_SCRIPT = HERE / "_torchrun_ddp.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="K=1 only, 2 kills per contender (about 80 s)")
    ap.add_argument("--ks", default=None, help="simultaneous kills per job, comma-separated (default 1,2,3)")
    ap.add_argument("--reps", type=int, default=None, help="kills per contender and K (default 4)")
    ap.add_argument("--world", type=int, default=6, help="workers / ranks per job")
    ap.add_argument("--speed", type=float, default=0.05, help="emulated speed of every worker / rank")
    ap.add_argument("--step-timeout-s", type=float, default=30.0, help="flotilla's strategy.step_timeout_s")
    ap.add_argument("--warmup-steps", type=int, default=10, help="committed steps per worker before the kill")
    ap.add_argument("--job-timeout-s", type=float, default=90.0, help="a kill not recovered by then fails")
    ap.add_argument("--start-timeout-s", type=float, default=180.0, help="give up on a job's start-up")
    ap.add_argument("--max-restarts", type=int, default=3, help="torchrun --max-restarts")
    ap.add_argument("--monitor-interval", type=float, default=0.1, help="torchrun --monitor-interval")
    ap.add_argument("--seed", type=int, default=0, help="victims and kill moments")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    ap.add_argument(
        "--check-task", action="store_true", help="check the DDP script's task against flotilla's"
    )
    a = ap.parse_args(argv)
    a.ks = [int(k) for k in str(a.ks or ("1" if a.quick else "1,2,3")).split(",")]
    a.reps = a.reps or (2 if a.quick else 4)
    if any(not 1 <= k < a.world for k in a.ks):
        ap.error(f"--ks: between 1 and {a.world - 1} kills (at least one survivor)")
    return a


# ---------------------------------------------------------------------------- flotilla


def flotilla_figures(recs: list[dict], name: str, world: int, k: int, kill_rel_s: float) -> dict[str, Any]:
    mine = sorted((r for r in recs if r["name"] == name), key=lambda r: r["time_s"])
    after = [r for r in mine if r["time_s"] >= kill_rel_s]
    commit = next((r for r in after if r["committed"] and r["world_size"] <= world - k), None)
    return {"recover_s": None if commit is None else commit["time_s"] - kill_rel_s}


def flotilla_lost(recs: list[dict], survivors: list[str], kill_rel_s: float) -> dict[str, Any]:
    """The steps whose work a survivor threw away after the kill: the discarded ones (and how
    many attempts) and any step a survivor committed twice (rolled back and redone)."""
    mine = [r for r in recs if r["name"] in survivors]
    discarded = [r for r in mine if not r["committed"] and r["time_s"] >= kill_rel_s]
    commits: dict[tuple[str, int], int] = {}
    for r in mine:
        if r["committed"]:
            key = (r["name"], int(r["step"]))
            commits[key] = commits.get(key, 0) + 1
    again = {step for (_, step), n in commits.items() if n > 1}  # rolled back and redone
    steps = {int(r["step"]) for r in discarded}
    return {
        "steps_lost": len(steps | again),
        "discarded_steps": sorted(steps),
        "recommitted_steps": sorted(again),
        "attempts_discarded": len(discarded),
    }


def flotilla_kill(a: argparse.Namespace, job_dir: Path, k: int, rng: random.Random) -> dict[str, Any]:
    world = a.world
    report, run_dir = job_dir / "report", job_dir / "run"
    cpu0, t_job = cpu_jiffies(), time.monotonic()
    out: dict[str, Any] = {"contender": "flotilla", "k": k, "loadavg_start": os.getloadavg()[0]}
    with Children() as children:
        proc = start_job(a, world, job_dir, children)
        try:
            if not wait_until(
                lambda: warmed_up(training_records(report), world, a.warmup_steps), a.start_timeout_s, proc
            ):
                log = (job_dir / "launcher.log").read_text(errors="replace")[-3000:]
                raise SystemExit(f"flotilla did not reach step {a.warmup_steps} (exit {proc.poll()}):\n{log}")
            recs = training_records(report)
            latest = {
                r["name"]: r
                for r in sorted(recs, key=lambda r: r["time_s"])
                if r["committed"] and r["world_size"] == world
            }
            ranks = {name: int(r["rank"]) for name, r in latest.items()}
            by_rank = {rank: name for name, rank in ranks.items()}
            victims = [by_rank[r] for r in sorted(rng.sample(range(world), k))]
            survivors = sorted((n for n in ranks if n not in victims), key=lambda n: ranks[n])
            t0_unix = run_t0_unix(run_dir)
            step_period = median(period(recs, survivors, world))
            time.sleep(rng.uniform(0.0, step_period))  # a random moment over a step
            cpu_kill = cpu_jiffies()
            kill_rel_s = time.time() - t0_unix
            for v in victims:
                os.kill(int(latest[v]["pid"]), signal.SIGKILL)
            t_kill = time.monotonic()

            def settled() -> bool:
                recs = training_records(report)
                return all(
                    flotilla_figures(recs, n, world, k, kill_rel_s)["recover_s"] is not None
                    for n in survivors
                )

            recovered = wait_until(settled, a.job_timeout_s, proc)
            out["cpu_recovery"] = cpu_busy(cpu_kill)
            waited_s = time.monotonic() - t_kill
        finally:
            exit_code = stop_job(proc, run_dir)
    recs = training_records(report)
    per = []
    for name in survivors:
        fig = flotilla_figures(recs, name, world, k, kill_rel_s)
        per.append(fig["recover_s"] if fig["recover_s"] is not None else max(waited_s, a.job_timeout_s))
    out.update(
        victims=[f"{v}(r{ranks[v]})" for v in victims],
        recover_s=per,
        failed=not recovered,
        **flotilla_lost(recs, survivors, kill_rel_s),
        step_period_s=step_period,
        split_votes=split_votes(recs, survivors),
        digest_mismatches=digest_mismatches(recs, survivors),
        launcher_exit=exit_code,
        job_wall_s=time.monotonic() - t_job,
        cpu_job=cpu_busy(cpu0),
    )
    return out


# ---------------------------------------------------------------------------- torchrun


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ddp_records(out_dir: Path) -> list[dict]:
    """Every rank's records (a line being written is skipped)."""
    recs = []
    for path in sorted(out_dir.glob("rank*.jsonl")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                pass
    return recs


def start_torchrun(a: argparse.Namespace, job_dir: Path, children: Children) -> subprocess.Popen:
    out = job_dir / "out"
    out.mkdir()
    cmd = [python(), "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(a.world)]
    cmd += ["--max-restarts", str(a.max_restarts), "--monitor-interval", str(a.monitor_interval)]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    cmd += [str(DDP_SCRIPT), "--out", str(out), "--speed", str(a.speed), "--seed", "0"]
    # the shared agent store hands a restarted group the previous group's gloo addresses
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    with open(job_dir / "agent.log", "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=job_dir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    children.procs.append(proc)
    return proc


def ddp_steps(recs: list[dict], restart: int | None = None) -> list[dict]:
    return [r for r in recs if r["kind"] == "step" and (restart is None or r["restart"] == restart)]


def ddp_incarnation(recs: list[dict]) -> int:
    """The newest group's restart count (0: the first group)."""
    return max((int(r["restart"]) for r in recs), default=0)


def ddp_warm(recs: list[dict], world: int, steps: int, restart: int) -> bool:
    done: dict[int, int] = {}
    for r in ddp_steps(recs, restart):
        done[r["rank"]] = done.get(r["rank"], 0) + 1
    return len(done) == world and min(done.values()) >= steps


def ddp_first_after(recs: list[dict], restart: int) -> dict[int, dict]:
    """Each rank's first step committed by a group started after group ``restart``."""
    first: dict[int, dict] = {}
    for r in sorted(ddp_steps(recs), key=lambda r: r["time_s"]):
        if r["restart"] > restart and r["rank"] not in first:
            first[r["rank"]] = r
    return first


def ddp_lost(recs: list[dict], restart: int) -> int:
    """Distinct steps whose work was thrown away when group ``restart`` was killed: each of its
    ranks' in-flight step (its last commit + 1) and every step it committed that a later group
    committed again (since the checkpoint it resumed from)."""
    old = ddp_steps(recs, restart)
    new = {int(r["step"]) for r in ddp_steps(recs) if r["restart"] > restart}
    last: dict[int, int] = {}
    for r in old:
        last[r["rank"]] = max(last.get(r["rank"], -1), int(r["step"]))
    in_flight = {s + 1 for s in last.values()}
    return len(in_flight | ({int(r["step"]) for r in old} & new))


def torchrun_job(
    a: argparse.Namespace, job_dir: Path, ks: list[int], rng: random.Random
) -> list[dict[str, Any]]:
    """One torchrun job, one kill of ``k`` ranks per entry of ``ks``, each once the current group
    is warm; stops at the first kill the job did not recover from."""
    world, out_dir = a.world, job_dir / "out"
    kills: list[dict[str, Any]] = []
    with Children() as children:
        proc = start_torchrun(a, job_dir, children)
        try:
            for k in ks:
                cpu0, t0 = cpu_jiffies(), time.monotonic()
                r0 = ddp_incarnation(ddp_records(out_dir))
                x: dict[str, Any] = {"contender": "torchrun", "k": k, "loadavg_start": os.getloadavg()[0]}
                if not wait_until(
                    lambda r0=r0: ddp_warm(ddp_records(out_dir), world, a.warmup_steps, r0),
                    a.start_timeout_s,
                    proc,
                ):
                    log = (job_dir / "agent.log").read_text(errors="replace")[-3000:]
                    raise SystemExit(
                        f"torchrun group {r0} did not reach {a.warmup_steps} steps "
                        f"(exit {proc.poll()}):\n{log}"
                    )
                recs = ddp_records(out_dir)
                if ddp_incarnation(recs) != r0:
                    raise SystemExit(f"torchrun restarted before the kill: see {job_dir / 'agent.log'}")
                mine = sorted(ddp_steps(recs, r0), key=lambda r: r["time_s"])
                latest = {r["rank"]: r for r in mine}
                victims = sorted(rng.sample(range(world), k))
                times = [r["time_s"] for r in mine if r["rank"] == 0][-20:]
                step_period = median([b - a_ for a_, b in zip(times, times[1:])])
                time.sleep(rng.uniform(0.0, step_period))  # a random moment over a step
                cpu_kill = cpu_jiffies()
                kill_s = time.time()
                for v in victims:
                    os.kill(int(latest[v]["pid"]), signal.SIGKILL)
                t_kill = time.monotonic()
                recovered = wait_until(
                    lambda r0=r0: len(ddp_first_after(ddp_records(out_dir), r0)) == world,
                    a.job_timeout_s,
                    proc,
                )
                x.update(
                    group=r0,
                    victims=[f"r{v}" for v in victims],
                    kill_s=kill_s,
                    failed=not recovered,
                    waited_s=time.monotonic() - t_kill,
                    step_period_s=step_period,
                    cpu_recovery=cpu_busy(cpu_kill),
                    cpu_job=cpu_busy(cpu0),
                    job_wall_s=time.monotonic() - t0,
                )
                kills.append(x)
                if not recovered:
                    break
        finally:
            exit_code = proc.poll()
            if exit_code is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            for pid in processes_mentioning(str(out_dir)):  # the ranks live in sessions of their own
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    recs = ddp_records(out_dir)
    for x in kills:
        r0, kill_s = x["group"], x.pop("kill_s")
        first = ddp_first_after(recs, r0)
        bound = max(x.pop("waited_s"), a.job_timeout_s)
        later = [r for r in recs if r["restart"] > r0]
        new = min((r["restart"] for r in first.values()), default=None)
        started = [r["time_s"] for r in later if r["kind"] == "start" and r["restart"] == new]
        ready = [r for r in later if r["kind"] == "ready" and r["restart"] == new]
        x.update(
            recover_s=[first[r]["time_s"] - kill_s if r in first else bound for r in range(world)],
            steps_lost=ddp_lost(recs, r0),
            restarts=(new - r0) if new is not None else ddp_incarnation(recs) - r0,
            procs_started_s=min(started) - kill_s if started else None,
            ready_s=max(r["time_s"] for r in ready) - kill_s
            if len({r["rank"] for r in ready}) == world
            else None,
            resume_step=min((r["resume_step"] for r in ready), default=None),
            agent_exit=exit_code,
        )
    return kills


# ---------------------------------------------------------------------------- report


def print_kill(i: int, total: int, rep: int, x: dict[str, Any]) -> None:
    rec = x["recover_s"]
    extra = ""
    if x["contender"] == "torchrun":
        parts = [f"restarts {x['restarts']}"]
        if x["procs_started_s"] is not None:
            parts.append(f"new procs +{x['procs_started_s']:.2f} s")
        if x["ready_s"] is not None:
            parts.append(f"all ready +{x['ready_s']:.2f} s (resumed at step {x['resume_step']})")
        extra = " | " + ", ".join(parts)
    else:
        if x["split_votes"]:  # resolved by a roll-forward (see crash_recovery.py)
            extra += f" | split votes {len(x['split_votes'])} (rolled forward)"
        if x["digest_mismatches"]:
            extra += f" | REPLICAS DIFFER at steps {x['digest_mismatches'][:5]}"
    print(
        f"kill {i:2d}/{total} rep {rep + 1} K={x['k']} {x['contender']:8s} "
        f"victims {','.join(x['victims'])} | "
        f"{'FAILED ' if x['failed'] else ''}recover p50 {median(rec):.3f} s max {max(rec):.3f} s | "
        f"steps lost {x['steps_lost']} | step {x['step_period_s'] * 1000:.0f} ms | cpu job "
        f"{x['cpu_job'] * 100:.0f}% recovery {x['cpu_recovery'] * 100:.0f}% | load {x['loadavg_start']:.1f}"
        + extra,
        flush=True,
    )
    if x.get("kept_logs"):
        print(f"    not recovered: logs kept in {x['kept_logs']}", flush=True)


def check_task() -> int:
    """The DDP script's model, data and shards against flotilla's own (imports flotilla)."""
    import torch

    import _torchrun_ddp as ddp
    from flotilla.data.sampler import GlobalBatchSampler
    from flotilla.trainer.zoo_tasks import ZooTask

    task = ZooTask(model="tiny_mlp", dataset="synthetic", num_samples=2000, test_fraction=0.2, seed=0)
    ref, mine = task.build_model().state_dict(), ddp.tiny_mlp(0).state_dict()
    same_model = list(ref) == list(mine) and all(torch.equal(ref[n], mine[n]) for n in ref)
    x, y = task.train_data()
    xm, ym = ddp.synthetic_train()
    same_data = torch.equal(x, torch.from_numpy(xm)) and torch.equal(y, torch.from_numpy(ym))
    sampler = GlobalBatchSampler(num_samples=len(y), global_batch_size=ddp.BATCH, seed=0)
    same_shards = all(
        (sampler.batch_len(s), sampler.shard(s, r, w).tolist()) == (n, idx.tolist())
        for s in range(0, 80, 3)
        for w in (3, 4, 5, 6)
        for r in range(w)
        for n, idx in [ddp.shard(len(y), 0, s, r, w)]
    )
    print(f"model equal: {same_model}; data equal: {same_data}; shards equal: {same_shards}")
    return 0 if same_model and same_data and same_shards else 1


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.check_task:
        return check_task()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rng = random.Random(a.seed)
    t_start, cpu0 = time.monotonic(), cpu_jiffies()
    info = machine_info()
    plan = [
        (rep, k, c) for rep in range(a.reps) for k in a.ks for c in (CONTENDERS[:: 1 if rep % 2 == 0 else -1])
    ]
    if a.quick:
        print(
            "QUICK run: K=1 only and 2 kills per contender; the full run does K=1,2,3 x 4 kills", flush=True
        )
    print(
        f"recovery vs restart: {a.world} workers, K in {a.ks}, {a.reps} kills per contender and K, "
        f"speed {a.speed}, kill after {a.warmup_steps} steps, bound {a.job_timeout_s:.0f} s; "
        f"{info['cpu_model']}, nproc {info['nproc']}, torch {info['torch']}, "
        f"loadavg {info.get('loadavg_1m', 0):.2f}",
        flush=True,
    )
    kills: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="recovery-vs-restart-") as tmp:
        i = 0
        while i < len(plan):
            rep, k, contender = plan[i]
            if contender == "flotilla":
                batch = [plan[i]]
            else:  # consecutive torchrun kills share a job, one restart each
                n = 1
                while n < a.max_restarts and i + n < len(plan) and plan[i + n][2] == "torchrun":
                    n += 1
                batch = plan[i : i + n]
            job_dir = Path(tmp) / f"job{i:03d}-{contender}"
            job_dir.mkdir()
            if contender == "flotilla":
                done = [flotilla_kill(a, job_dir, k, rng)]
            else:
                done = torchrun_job(a, job_dir, [b[1] for b in batch], rng)
            for x, (rep, _, _) in zip(done, batch):
                x.update(rep=rep, job=str(job_dir.name))
                if x["failed"]:
                    kept = Path(tempfile.mkdtemp(prefix=f"recovery-vs-restart-{contender}-k{x['k']}-"))
                    shutil.copytree(job_dir, kept, dirs_exist_ok=True)
                    x["kept_logs"] = str(kept)
                kills.append(x)
                print_kill(len(kills), len(plan), rep, x)
            i += len(done)

    def slowest(c: str, k: int) -> list[float]:
        return [max(x["recover_s"]) for x in kills if x["contender"] == c and x["k"] == k]

    summary: dict[str, Any] = {}
    print(
        f"machine: loadavg {os.getloadavg()[0]:.2f}, cpu busy {cpu_busy(cpu0) * 100:.0f}% over "
        f"{time.monotonic() - t_start:.0f} s"
    )
    print("recovery = kill -> every survivor (flotilla) / every restarted rank (torchrun) committed a step")
    for k in a.ks:
        row: dict[str, Any] = {}
        for c in CONTENDERS:
            xs = [x for x in kills if x["contender"] == c and x["k"] == k]
            row[c] = {
                "median_max_s": median(slowest(c, k)),
                "median_p50_s": median([median(x["recover_s"]) for x in xs]),
                "median_steps_lost": median([x["steps_lost"] for x in xs]),
                "failures": sum(x["failed"] for x in xs),
                "n": len(xs),
            }
        row["ratio"] = row["flotilla"]["median_max_s"] / row["torchrun"]["median_max_s"]
        summary[f"k{k}"] = row
        f, t = row["flotilla"], row["torchrun"]
        print(
            f"K={k}: flotilla median {f['median_max_s']:.3f} s (p50 {f['median_p50_s']:.3f}, steps lost "
            f"{f['median_steps_lost']:g}, failures {f['failures']}/{f['n']}) | torchrun median "
            f"{t['median_max_s']:.3f} s (p50 {t['median_p50_s']:.3f}, steps lost {t['median_steps_lost']:g}, "
            f"failures {t['failures']}/{t['n']}) | ratio {row['ratio']:.4f}"
        )
    if len(a.ks) > 1:
        lo, hi = min(a.ks), max(a.ks)
        for c in CONTENDERS:
            slope = (summary[f"k{hi}"][c]["median_max_s"] - summary[f"k{lo}"][c]["median_max_s"]) / (hi - lo)
            summary[f"slope_ms_per_kill_{c}"] = slope * 1000
        print(
            f"recovery slope per extra simultaneous revocation (K={lo}..{hi}): flotilla "
            f"{summary['slope_ms_per_kill_flotilla']:+.1f} ms/kill "
            f"(torchrun {summary['slope_ms_per_kill_torchrun']:+.0f} ms/kill)"
        )
    failures = sum(x["failed"] for x in kills)
    diverged = sum(1 for x in kills if x.get("digest_mismatches"))
    if failures or diverged:
        print(f"FAILURES: {failures} kills not recovered; {diverged} flotilla kills with differing replicas")
    ratio = summary["k1"]["ratio"] if "k1" in summary else float("nan")
    if a.json:
        write_json(
            a.json,
            {
                "args": {k: str(v) for k, v in vars(a).items()},
                "machine": info,
                "kills": kills,
                "summary": summary,
                "failures": failures,
                "diverged": diverged,
                "ratio": ratio,
            },
        )
    print(f"ratio={ratio:.4f}")
    return 1 if failures or diverged else 0


if __name__ == "__main__":
    sys.exit(main())
