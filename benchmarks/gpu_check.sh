#!/usr/bin/env bash
# The GPU check (issue 34): what anyone with a GPU runs to verify flotilla's GPU path in minutes.
#
#   benchmarks/gpu_check.sh [WHEELS_DIR]      # default WHEELS_DIR: .whl (see docs/gpu.md)
#
# Uses the machine's own python3 and torch (nothing from the network; no `make setup`): packages
# flotilla needs that python3 lacks are installed from WHEELS_DIR into a scratch directory put on
# PYTHONPATH.  Runs tests/gpu (every strategy on cuda, the pipeline against the CPU losses, the
# collective plane), then the overhead benchmark on the GPU (fp32), and prints one line per result
# ("RESULT ...").  Outputs go to $OUT (or $GPU_CHECK_OUT, default /tmp/flotilla-gpu-check).
# Budget: about 7 minutes on one H100/H200; the steps are bounded by `timeout`.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${1:-.whl}
OUTDIR=${GPU_CHECK_OUT:-${OUT:-/tmp/flotilla-gpu-check}}
mkdir -p "$OUTDIR"
SITE=$(mktemp -d /tmp/flotilla-site.XXXXXX)
missing=$($PY - <<'PY'
import importlib.util
need = {"zmq": "pyzmq", "blake3": "blake3", "pydantic": "pydantic", "mnist1d": "mnist1d",
        "msgpack": "msgpack", "yaml": "PyYAML", "typer": "typer", "rich": "rich",
        "safetensors": "safetensors", "matplotlib": "matplotlib", "setproctitle": "setproctitle"}
print(" ".join(v for k, v in need.items() if importlib.util.find_spec(k) is None))
PY
)
if [ -n "$missing" ]; then
  echo "missing here: $missing; installing from $WHEELS"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
    || { echo "RESULT setup FAILED: could not install wheels from $WHEELS"; exit 2; }
fi
export PYTHONPATH="$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
$PY - <<'PY' | tee "$OUTDIR/machine.txt"
import subprocess, torch
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
except OSError:
    smi = ""
print(f"RESULT machine: {smi or 'nvidia-smi: none'}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
      f"cuda available {torch.cuda.is_available()}, {torch.cuda.device_count()} GPU(s); "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else '-'}")
PY
if ! $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "RESULT no usable CUDA device here: nothing to check"
  exit 3
fi
status=0
# 1. pipeline_lm with its stages on cuda against the same run on cpu (losses within 1e-4, final
#    2 %), in the background while 2. tests/gpu runs: every strategy on cuda, the pipeline schedules
#    against CPU losses, the collective plane, a killed GPU worker (16 cores hold both)
timeout 240 $PY benchmarks/gpu_pipeline_match.py --out "$OUTDIR/pipeline_match" --timeout-s 230 \
  > "$OUTDIR/pipeline_match.log" 2>&1 &
match=$!
timeout 280 $PY -m pytest tests/gpu -m gpu -p no:cacheprovider -o addopts="" -q -rA -n 8 --timeout 250 \
  > "$OUTDIR/tests_gpu.log" 2>&1
rc=$?
grep -E "^(PASSED|FAILED|SKIPPED|ERROR)" "$OUTDIR/tests_gpu.log" | sed 's/^/RESULT tests\/gpu: /'
tail -1 "$OUTDIR/tests_gpu.log" | sed 's/^/RESULT tests\/gpu summary: /'
[ $rc -eq 0 ] || status=1
wait $match
rc=$?
grep "^RESULT" "$OUTDIR/pipeline_match.log"
[ $rc -eq 0 ] || { status=1; tail -5 "$OUTDIR/pipeline_match.log" | sed 's/^/RESULT pipeline match: /'; }
# 3. the overhead on a fast device: flotilla (1 worker, cuda) against a plain loop, alternating,
#    in fp32 and in bf16 (autocast in both contenders)
for precision in fp32 bf16; do
  timeout 200 $PY benchmarks/overhead_vs_plain.py --device cuda --precision $precision --task transformer \
    --batch 32 --steps 300 --rounds 3 --workers 1 --json "$OUTDIR/overhead_cuda_$precision.json" \
    > "$OUTDIR/overhead_cuda_$precision.log" 2>&1
  rc=$?
  grep -E "^(ratio=|ms per step|median over rounds of the median step|median steady-state)" \
    "$OUTDIR/overhead_cuda_$precision.log" \
    | sed "s/^/RESULT overhead cuda transformer $precision: /"
  [ $rc -eq 0 ] || { status=1; tail -5 "$OUTDIR/overhead_cuda_$precision.log" | sed 's/^/RESULT overhead FAILED: /'; }
done
echo "RESULT done: exit status $status (logs in $OUTDIR)"
exit $status
