#!/usr/bin/env bash
# dvla's further GPU figures, a call after the GPU kit (bench/gpu_kit.sh, the first one: the
# CUDA tests, the GPU paths, the memory pools and the learner's figures are its steps now).
#
#   bench/gpu_suite.sh [--out FILE]        on the GPU machine (budget: about 6 minutes on one GPU)
#   bench/gpu_suite.sh --cpu-smoke         the same steps, tiny, on the CPU (CI runs this)
#   bench/gpu_suite.sh --only a,b          only the steps named (either mode)
#
# Every step prints its figures as ratios against a baseline measured in the same run. A step
# that fails or runs out of time is reported and the suite goes on; the exit status is the
# number of failed steps. Everything printed also goes to FILE (default runs/gpu_suite.txt)
# for bench/RESULTS.md.
#
# Steps:
#   broadcast  control-plane broadcast vs one raw broadcast (NCCL with >= 2 GPUs, else gloo)
#   overlap    inference and learning at once, each lane on its own CUDA stream vs the default stream
#   swimlane   async vs sync on genesis_reach with its GPU backend (fast_reach in the smoke)
#   dataplane  the ZeroMQ data plane vs raw sockets
#   libero     LIBERO on the GPU (EGL on the rank's GPU), where the [libero] extra is installed
#
# One GPU runs every step above but NCCL between ranks (it needs a GPU per rank): the broadcast
# over NCCL, the learners' all-reduce and FSDP across ranks, the hierarchical broadcast and
# NCCL teardown after a failure run only on a machine of two GPUs or more (tests/integration/test_nccl.py).
set -uo pipefail
cd "$(dirname "$0")/.."

SMOKE=0
ONLY=
OUT=runs/gpu_suite.txt
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-smoke) SMOKE=1 ;;
    --out) OUT="$2"; shift ;;
    --only) ONLY=",$2,"; shift ;;
    *) echo "gpu_suite.sh: unknown argument $1 (use --cpu-smoke, --only STEPS, --out FILE)" >&2; exit 2 ;;
  esac
  shift
done
for name in ${ONLY//,/ }; do
  case "$name" in
    broadcast|overlap|swimlane|dataplane|libero) ;;
    *) echo "gpu_suite.sh: --only: unknown step $name (see the list at the top of this script)" >&2; exit 2 ;;
  esac
done
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
PY=${PYTHON:-python}
FAILED=0

step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  if [ -n "$ONLY" ] && [[ "$ONLY" != *",$name,"* ]]; then return 0; fi
  echo "== $name: $*" | tee -a "$OUT"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT"
  [ "$rc" -eq 0 ] || FAILED=$((FAILED + 1))
}

{
  echo "dvla gpu_suite $(date -u +%Y-%m-%dT%H:%MZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo ?) smoke=$SMOKE"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count(), 'GPU(s)', torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
  nproc | sed 's/^/cpu cores /'
} 2>&1 | tee -a "$OUT"

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)

if [ "$SMOKE" -eq 1 ]; then
  step broadcast 120 "$PY" bench/weight_broadcast.py --world 2 --mb 4 --layers 8 --repeats 1
  step overlap 120 "$PY" bench/stream_overlap.py --size tiny --device cpu --samples 4 --infer-batch 4 --infer 2 \
    --updates 1 --image 32 --repeats 1
  step swimlane 240 "$PY" bench/async_vs_sync.py --iterations 2 --envs 8 --image 16 --repeats 1 \
    --render-cost-ms 1 --gantt "$(dirname "$OUT")/gpu_suite_gantt.png"
  step dataplane 120 "$PY" bench/data_plane.py --messages 20 --blocks 2
else
  if [ "$GPUS" -ge 2 ]; then
    step broadcast 90 "$PY" bench/weight_broadcast.py --world 2 --mb 1000 --layers 200 --repeats 5
  else
    echo "== broadcast: NCCL needs two GPUs (this machine has $GPUS); gloo on the CPU instead" | tee -a "$OUT"
    step broadcast 90 env CUDA_VISIBLE_DEVICES= "$PY" bench/weight_broadcast.py --world 2 --mb 200 --repeats 5
  fi
  step overlap 60 "$PY" bench/stream_overlap.py --size 0.5b --device cuda --repeats 3
  step swimlane 150 "$PY" bench/async_vs_sync.py --env genesis_reach --iterations 6 --envs 64 --image 64 \
    --repeats 1 --threads 4 --gantt "$(dirname "$OUT")/gpu_suite_gantt.png" --set run.device=cuda
  step dataplane 60 "$PY" bench/data_plane.py --messages 200 --blocks 5
  if "$PY" -c "import libero.libero" 2>/dev/null; then
    step libero 240 "$PY" -m dvla.launch --preset libero_spatial run.device=cuda run.iterations=2 env.n_envs=8 \
      run.out_dir=runs/gpu_suite_libero run.progress=false
  else
    echo "== libero: not installed (pip install -e \".[libero]\"), skipped" | tee -a "$OUT"
  fi
fi
echo "== gpu_suite: $FAILED step(s) failed; output in $OUT" | tee -a "$OUT"
exit "$FAILED"
