#!/usr/bin/env bash
# Multi-node training with torchrun: the same command on every node, joined by c10d rendezvous.
#
# What this shows
#   * The torchrun line for one node of an N-node job: c10d rendezvous on one node's address,
#     checkpoints every SAVE_EVERY learner updates (run.save_every) and --max-restarts, so a
#     crashed worker group is restarted by torchrun and resumes from the newest checkpoint.
#   * --demo: two "nodes" on this one machine. Two torchrun agents start in the background,
#     each told it is a different host (DVLA_FAKE_HOSTNAME=nodeA / nodeB), rendezvous on a
#     free loopback port and train together; the script waits for both. Rank 0 then reports
#     the placement: learners, the weight broadcast tree (one leader per host) and the hosts.
#
# Run it
#   On every node of a real cluster (same RDZV_ENDPOINT and RDZV_ID everywhere, NODE_RANK 0..N-1):
#     NNODES=2 NODE_RANK=0 NPROC_PER_NODE=8 RDZV_ENDPOINT=10.0.0.1:29500 \
#       OUT_DIR=/shared/runs/reach examples/multinode.sh swimlane.learner_ranks=2
#   One machine, two pretend nodes of two processes each (under a minute on 2 CPU cores):
#     examples/multinode.sh --demo
#     examples/multinode.sh --demo run.iterations=4 env.n_envs=16        # shorter
#   Print the torchrun command instead of running it:
#     NNODES=4 NODE_RANK=3 examples/multinode.sh --dry-run
#
# Settings (environment variables; defaults give a one-machine run)
#   NNODES=1  NODE_RANK=0  NPROC_PER_NODE=2  RDZV_ENDPOINT=127.0.0.1:29500  RDZV_ID=dvla-multinode
#   PRESET=fast_reach  OUT_DIR=runs/examples/multinode  SAVE_EVERY=5  MAX_RESTARTS=3
#   PYTHON=python (used when torchrun is not on PATH, and for the demo's helpers)
# Arguments after the options are dvla overrides (KEY=VALUE), passed to every rank.
# OUT_DIR should be on a filesystem every node shares: each run gets its own directory in it,
# OUT_DIR/<YYYYmmdd-HHMMSS> (OUT_DIR/latest points to the newest; run.name=NAME fixes it), where
# rank 0 writes metrics, summary.json and checkpoints, the other ranks their summary_rank{N}.json;
# a restarted worker group continues OUT_DIR/latest. Only run on a private network:
# torch.distributed's store and gloo/NCCL traffic are neither authenticated nor encrypted.
set -euo pipefail

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
NPROC_PER_NODE=${NPROC_PER_NODE:-2}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-127.0.0.1:29500}
RDZV_ID=${RDZV_ID:-dvla-multinode}
PRESET=${PRESET:-fast_reach}
OUT_DIR=${OUT_DIR:-runs/examples/multinode}
SAVE_EVERY=${SAVE_EVERY:-5}
MAX_RESTARTS=${MAX_RESTARTS:-3}
PYTHON=${PYTHON:-python}

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

mode=run
while [[ $# -gt 0 ]]; do
  case "$1" in
    --demo) mode=demo; shift ;;
    --dry-run) mode=dry-run; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    -*) echo "multinode.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
OVERRIDES=("$@")

if command -v torchrun >/dev/null 2>&1; then
  TORCHRUN=(torchrun)
else
  TORCHRUN=("$PYTHON" -m torch.distributed.run)
fi

# The command for one node. Overrides given on the command line come last and win.
node_command() {  # node_rank nnodes endpoint rdzv_id
  CMD=("${TORCHRUN[@]}" --nnodes="$2" --node_rank="$1" --nproc_per_node="$NPROC_PER_NODE"
       --rdzv_backend=c10d --rdzv_endpoint="$3" --rdzv_id="$4" --max-restarts="$MAX_RESTARTS"
       -m dvla.launch --preset "$PRESET"
       run.out_dir="$OUT_DIR" run.save_every="$SAVE_EVERY" run.progress=false
       ${OVERRIDES[@]+"${OVERRIDES[@]}"})
}

case "$mode" in
  dry-run)
    node_command "$NODE_RANK" "$NNODES" "$RDZV_ENDPOINT" "$RDZV_ID"
    printf '%q ' "${CMD[@]}"; echo
    ;;

  run)
    node_command "$NODE_RANK" "$NNODES" "$RDZV_ENDPOINT" "$RDZV_ID"
    exec "${CMD[@]}"
    ;;

  demo)
    port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    rdzv_id="dvla-demo-$$"
    echo "demo: 2 nodes x $NPROC_PER_NODE processes, rendezvous 127.0.0.1:$port, output in $OUT_DIR/<time> (then $OUT_DIR/latest)"
    pids=()
    stop_nodes() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; }
    trap 'stop_nodes; exit 130' INT TERM
    for node in 0 1; do
      host=$([[ $node == 0 ]] && echo nodeA || echo nodeB)
      node_command "$node" 2 "127.0.0.1:$port" "$rdzv_id"
      # Each agent's output goes through a prefixing filter; $! is the agent itself.
      DVLA_FAKE_HOSTNAME=$host PYTHONUNBUFFERED=1 "${CMD[@]}" > >(sed -u "s/^/[$host] /") 2>&1 &
      pids+=($!)
    done
    status=0
    for p in "${pids[@]}"; do wait "$p" || status=$?; done
    trap - INT TERM
    sleep 0.2  # let the output filters flush
    if [[ $status -ne 0 ]]; then
      echo "demo: a node failed (exit $status)" >&2
      exit "$status"
    fi
    "$PYTHON" - "$OUT_DIR" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1]) / "latest"  # this run's directory
s0 = json.loads((out / "summary.json").read_text())
hosts = {0: s0["host"]}
for f in out.glob("summary_rank*.json"):
    s = json.loads(f.read_text())
    hosts[s["rank"]] = s["host"]
tree = s0["placement"]["tree"]
print(f"demo: {s0['version']} updates, final success {s0['final_success_rate']:.2f}")
print("demo: ranks by host:", {h: sorted(r for r in hosts if hosts[r] == h) for h in sorted(set(hosts.values()))})
print(f"demo: broadcast tree leaders {tree['leaders']}, local groups {tree['local_groups']}")
print(f"demo: outputs in {out.resolve()}")
EOF
    ;;
esac
