#!/usr/bin/env bash
# The VLA RL recipe on LIBERO (issue #40), end to end:
#   1. the scripted expert's demonstrations, from new initial states (not the evaluation's)
#   2. dvla sft on them (a camera-reading policy)
#   3. dvla eval of the SFT run on the suite's fixed initial states
#   4. GRPO from the SFT run (policy.init; its KL reference is the SFT policy)
#   5. dvla eval of the RL run on the same states, side by side with the SFT run (once per
#      RL_ITERS: a later invocation with more updates evaluates again)
#   6. the plot: success over RL updates, with both evaluations
#
#   bench/libero_recipe.sh [cpu|gpu]
#
# Every stage skips itself where its output is there, and RL goes on with --resume where its
# run exists, so the script can be stopped and run again (in several sessions on a CPU).
# Settings come from the profile and can be overridden from the environment: OUT, TASKS,
# RECORD (demonstrations recorded per task), DEMOS (of those, trained on per task), SFT_STEPS,
# RL_ITERS, N_ENVS, GROUP (GRPO's group size), TEMP (RL's sampling temperature,
# policy.temperature; RL runs in OUT/rl_tTEMP, OUT/rl at 1), WORKERS, EVAL_EPISODES, RL_TIME
# (seconds of RL per invocation; 0: no limit), EXTRA (more KEY=VALUE overrides for SFT and RL
# alike).
#
# cpu: two libero_spatial tasks, TinyVLA on a 64 px agent view, chunks of 8 actions; every
#      number in bench/RESULTS.md "The LIBERO recipe" comes from this profile (RL at TEMP=0.5:
#      57/100 -> 77/100 on the fixed states after its 110 updates). A rendering
#      LIBERO env holds about 1 GB (its textures, in MuJoCo and in its GL context), so 16
#      envs in one env group (ENV_GROUPS=1; the swimlane's default of 2 doubles them) fill
#      most of a 24 GiB machine.
# gpu: LIBERO's usual settings: all ten tasks, 50 demonstrations each, 128 px agent view and
#      wrist cameras, 50 fixed states per task; run.device=cuda; TEMP=0.5 as on the CPU (check
#      the SFT run's sampled success first: dvla eval --sample --temperature T). Not yet run.
set -euo pipefail
PROFILE=${1:-cpu}
case "$PROFILE" in
  cpu) : "${OUT:=runs/recipe_cpu}" "${TASKS:=0,1}" "${RECORD:=40}" "${DEMOS:=5}" "${SFT_STEPS:=2000}" "${RL_ITERS:=110}"
       : "${N_ENVS:=16}" "${WORKERS:=2}" "${EVAL_EPISODES:=50}" "${RL_TIME:=0}" "${IMAGE:=64}" "${WRIST:=0}"
       : "${GROUP:=4}" "${ENV_GROUPS:=1}" "${TEMP:=0.5}"
       DEVICE=cpu ;;
  gpu) : "${OUT:=runs/recipe_gpu}" "${TASKS:=0,1,2,3,4,5,6,7,8,9}" "${RECORD:=50}" "${DEMOS:=50}" "${SFT_STEPS:=30000}"
       : "${RL_ITERS:=200}" "${N_ENVS:=80}" "${WORKERS:=16}" "${EVAL_EPISODES:=50}" "${RL_TIME:=0}"
       : "${IMAGE:=128}" "${WRIST:=128}" "${GROUP:=8}" "${ENV_GROUPS:=2}" "${TEMP:=0.5}"
       DEVICE=cuda ;;
  *) echo "usage: $0 [cpu|gpu]" >&2; exit 2 ;;
esac
EXTRA=${EXTRA:-}
if [ "$TEMP" = 1 ]; then RL_NAME=rl; else RL_NAME=rl_t$TEMP; fi
RL_DIR=$OUT/$RL_NAME
CHUNK=8
N_TASKS=$(( $(tr -cd , <<<"$TASKS" | wc -c) + 1 ))
EPISODE_LEN=$(( (220 + CHUNK - 1) / CHUNK ))  # libero_spatial's evaluation length in decisions
mkdir -p "$OUT"
log() { echo "[recipe $(date +%H:%M:%S)] $*" | tee -a "$OUT/recipe.log"; }
timed() { local t0=$SECONDS; "$@"; log "  took $((SECONDS - t0)) s: $*"; }

# What SFT and RL share: the env (its spec) and the policy; RL must build the SFT run's policy.
COMMON=(--preset libero_spatial "env.options.task_ids=[$TASKS]" env.image_size="$IMAGE"
        env.options.wrist_size="$WRIST" policy.action_chunk=$CHUNK run.device=$DEVICE $EXTRA)

# 1. demonstrations: the expert from sampled initial states, successful episodes only
if [ ! -f "$OUT/demos/meta/info.json" ]; then
  log "1. recording $RECORD expert demonstrations per task ($TASKS)"
  timed dvla record --expert libero "${COMMON[@]}" env.options.init_states=sampled \
      env.n_envs=$(( N_TASKS * 4 )) env.options.workers="$WORKERS" \
      --episodes $(( RECORD * N_TASKS )) --success-only --out "$OUT/demos"
fi

# 2. supervised warm start
if [ ! -f "$OUT/sft/latest/weights.safetensors" ]; then
  log "2. dvla sft on $DEMOS demonstrations per task, $SFT_STEPS steps"
  timed dvla sft --data "$OUT/demos" --episodes-per-task "$DEMOS" "${COMMON[@]}" run.iterations="$SFT_STEPS" \
      --out "$OUT/sft"
fi

# 3. the SFT run on the fixed initial states
EVAL=(--suite libero_spatial --tasks "$TASKS" --episodes "$EVAL_EPISODES" --workers "$WORKERS")
if [ ! -f "$OUT/eval_sft.json" ]; then
  log "3. dvla eval of the SFT run"
  timed dvla eval "$OUT/sft/latest" "${EVAL[@]}" --out "$OUT/eval_sft.json"
fi

# 4. GRPO from the SFT run (resumed where it stopped; RL_TIME bounds one invocation), sampling
#    at TEMP: the SFT run's learned std is wider than the spread its actions still succeed with
#    (on the CPU profile, sampled success 0.15 at 1, 0.42 at 0.5, most likely actions 0.57)
RL=(-m dvla.launch "${COMMON[@]}" policy.init="$OUT/sft/latest" env.options.init_states=sampled
    env.n_envs="$N_ENVS" env.options.workers="$WORKERS" env.episode_len=$EPISODE_LEN
    algo.name=grpo algo.group_size="$GROUP" algo.lr=1e-4 algo.kl_coef=0.01 algo.update_epochs=2 algo.minibatches=4 policy.temperature="$TEMP"
    swimlane.mode=sync swimlane.env_groups="$ENV_GROUPS" run.iterations="$RL_ITERS" run.save_every=1 run.time_limit_s="$RL_TIME"
    run.out_dir="$RL_DIR")
if [ -f "$RL_DIR/latest/summary.json" ] && python -c "import json,sys; s=json.load(open('$RL_DIR/latest/summary.json')); \
sys.exit(0 if s.get('version', 0) >= $RL_ITERS else 1)"; then
  log "4. RL is done ($RL_ITERS updates)"
else
  if [ -d "$RL_DIR/latest/checkpoints" ]; then
    log "4. GRPO, resumed"; timed python "${RL[@]}" --resume
  else
    log "4. GRPO from the SFT run, $RL_ITERS updates"; timed python "${RL[@]}"
  fi
fi

# 5. the RL run on the same states, side by side with the SFT run
if python -c "import json,sys; s=json.load(open('$RL_DIR/latest/summary.json')); \
sys.exit(0 if s.get('version', 0) >= $RL_ITERS else 1)"; then
  if [ ! -f "$OUT/eval_sft_vs_${RL_NAME}_v$RL_ITERS.json" ]; then
    log "5. dvla eval: SFT and RL (after $RL_ITERS updates) side by side"
    timed dvla eval "$OUT/sft/latest" "$RL_DIR/latest" "${EVAL[@]}" --out "$OUT/eval_sft_vs_${RL_NAME}_v$RL_ITERS.json"
  fi
  # 6. the plot
  python bench/recipe_plot.py "$OUT" --out "$OUT/recipe.png"
else
  log "RL has not reached $RL_ITERS updates yet: run $0 $PROFILE again to go on"
fi
