#!/usr/bin/env bash
# The first thing to run on a machine with a GPU: dvla's GPU paths and figures in one go.
#
#   bench/gpu_suite.sh [--out FILE]        on the GPU machine (budget: about 8 minutes on one GPU)
#   bench/gpu_suite.sh --cpu-smoke         the same steps, tiny, on the CPU (CI runs this)
#   bench/gpu_suite.sh --only a,b          only the steps named (either mode)
#
# Every step prints its figures as ratios against a baseline measured in the same run. A step
# that fails or runs out of time is reported and the suite goes on; the exit status is the
# number of failed steps. Everything printed also goes to FILE (default runs/gpu_suite.txt)
# for bench/RESULTS.md.
#
# Steps:
#   gpu-tests  the tests that skip without CUDA (CUDA memory pools, lane streams, the NCCL group bound to its GPU; NCCL between ranks needs 2 GPUs)
#   colocated  one rank, async, memory pools + CUDA streams + bf16 replicas, several versions, new
#              inference batch shapes while the gradient lane updates (bench/gpu_paths.py)
#   receiver   two processes sharing the GPU: learner-only rank 0, rollout-only rank 1, the control
#              plane on gloo with CUDA tensors (bench/gpu_paths.py)
#   broadcast  control-plane broadcast vs one raw broadcast (NCCL with >= 2 GPUs, else gloo)
#   memory     CUDA memory pools vs the caching allocator under churn (peak reserved, fragmentation)
#   learner    token_vla learner updates: bf16 autocast and an FSDP2-sharded bf16 learner vs fp32
#              (tokens/s, MFU)
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
    gpu-tests|colocated|receiver|broadcast|memory|learner|overlap|swimlane|dataplane|libero) ;;
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
  if [ "$GPUS" -gt 0 ]; then
    step gpu-tests 90 "$PY" -m pytest -q -p no:cacheprovider tests/integration/test_nccl.py tests/unit/memory/test_memory.py tests/unit/swimlane/test_streams.py tests/unit/dvla/test_groups.py -k "cuda or nccl"
  else  # every one of them skips without CUDA: nothing to run
    echo "== gpu-tests: no CUDA here, skipped" | tee -a "$OUT"
  fi
  step colocated 120 "$PY" bench/gpu_paths.py colocated --device cpu --iterations 6 --envs 16 --image 16
  step receiver 180 "$PY" bench/gpu_paths.py receiver --device cpu --iterations 3 --envs 8 --image 16
  step broadcast 120 "$PY" bench/weight_broadcast.py --world 2 --mb 4 --layers 8 --repeats 1
  step memory 120 "$PY" bench/memory_churn.py --iters 20
  step learner 120 "$PY" bench/learner_step.py --size tiny --device cpu --samples 16 --updates 1 --image 32 --fsdp
  step overlap 120 "$PY" bench/stream_overlap.py --size tiny --device cpu --samples 4 --infer-batch 4 --infer 2 \
    --updates 1 --image 32 --repeats 1
  step swimlane 240 "$PY" bench/async_vs_sync.py --iterations 2 --envs 8 --image 16 --repeats 1 \
    --render-cost-ms 1 --gantt "$(dirname "$OUT")/gpu_suite_gantt.png"
  step dataplane 120 "$PY" bench/data_plane.py --messages 20 --blocks 2
else
  step gpu-tests 90 "$PY" -m pytest -q -p no:cacheprovider tests/integration/test_nccl.py tests/unit/memory/test_memory.py tests/unit/swimlane/test_streams.py tests/unit/dvla/test_groups.py -k "cuda or nccl"
  step colocated 120 "$PY" bench/gpu_paths.py colocated --device cuda --iterations 12 --envs 64 --image 64
  step receiver 150 "$PY" bench/gpu_paths.py receiver --device cuda --iterations 8 --envs 64 --image 64
  if [ "$GPUS" -ge 2 ]; then
    step broadcast 90 "$PY" bench/weight_broadcast.py --world 2 --mb 1000 --layers 200 --repeats 5
  else
    echo "== broadcast: NCCL needs two GPUs (this machine has $GPUS); gloo on the CPU instead" | tee -a "$OUT"
    step broadcast 90 env CUDA_VISIBLE_DEVICES= "$PY" bench/weight_broadcast.py --world 2 --mb 200 --repeats 5
  fi
  step memory 60 "$PY" bench/memory_churn.py --iters 300
  step learner 120 "$PY" bench/learner_step.py --size 0.5b --device cuda --samples 64 --micro-batch 16 --updates 3 --fsdp
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
