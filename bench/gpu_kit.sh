#!/usr/bin/env bash
# The GPU kit (bench/gpu_kit.py): prepare its wheels here, run it on a lent GPU machine in one
# call, or rehearse every step's CPU half here.
#
#   bench/gpu_kit.sh prepare [--wheels DIR]
#   bench/gpu_kit.sh run --out DIR [--wheels DIR] [--only a,b] [--budget S]
#   bench/gpu_kit.sh run --out DIR --cpu-rehearsal
#
# The lent machine has python3 and no python; $PYTHON overrides both.
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
exec "$PY" bench/gpu_kit.py "$@"
