"""``flotilla run examples/pipeline_lm.yaml`` with its stages on cuda against the same run on cpu
(issue 34's acceptance): the first 20 training losses within 1e-4 relative, the final loss within
2 %.  Both runs start together (the CPU one is the slow one); TF32 is off in both (torch's default
for matrix products; the model has no convolutions).

    python3 benchmarks/gpu_pipeline_match.py [--config examples/pipeline_lm.yaml] [--out DIR]

Prints ``RESULT`` lines and exits 1 if a bound is broken.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "examples" / "pipeline_lm.yaml"))
    ap.add_argument("--out", default=None, help="directory for the two runs (default: a temporary one)")
    ap.add_argument("--timeout-s", type=float, default=420.0)
    ap.add_argument("--first", type=int, default=20, help="leading losses compared at --rel")
    ap.add_argument("--rel", type=float, default=1e-4)
    ap.add_argument("--final-rel", type=float, default=0.02)
    a = ap.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="pipeline-match-"))
    procs, started = {}, time.monotonic()
    for device in ("cuda", "cpu"):
        d = out / device
        d.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "flotilla.cli.main", "run", a.config, "--report", str(d / "report")]
        argv += ["--run-dir", str(d / "run"), "--no-progress", "--set", f"cluster.defaults.device={device}"]
        log = open(d / "launcher.log", "w")
        procs[device] = (
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)),
            log,
        )
    losses, walls = {}, {}
    for device, (proc, log) in procs.items():
        try:
            rc = proc.wait(timeout=max(1.0, a.timeout_s - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = -9
        log.close()
        walls[device] = time.monotonic() - started
        if rc != 0:
            tail = (out / device / "launcher.log").read_text()[-1500:]
            print(f"RESULT pipeline_lm {device}: FAILED (exit code {rc})\n{tail}")
            return 1
        summary = json.loads((out / device / "report" / "summary.json").read_text())
        losses[device] = summary["train_losses"]
        stages = [s.get("device") for s in summary.get("stages", [])]
        print(f"RESULT pipeline_lm {device}: {len(losses[device])} steps, stages on {stages}, "
              f"final loss {losses[device][-1]:.5f}, done after {walls[device]:.0f} s")  # fmt: skip
    gpu, cpu = losses["cuda"], losses["cpu"]
    n = min(a.first, len(gpu), len(cpu))
    worst = max(abs(g - c) / abs(c) for g, c in zip(gpu[:n], cpu[:n]))
    final = abs(gpu[-1] - cpu[-1]) / abs(cpu[-1])
    ok = worst <= a.rel and final <= a.final_rel and len(gpu) == len(cpu)
    print(f"RESULT pipeline_lm cuda vs cpu: first {n} losses max relative difference {worst:.2e} "
          f"(bound {a.rel:g}); final loss {gpu[-1]:.5f} vs {cpu[-1]:.5f}, {100 * final:.2f} % "
          f"(bound {100 * a.final_rel:g} %): {'ok' if ok else 'FAILED'}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
