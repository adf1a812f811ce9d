#!/usr/bin/env bash
# The main job on the built-in default: build stoke, prepare Fashion-MNIST
# (Debian's dataset-fashion-mnist) into an LMDB database, show it, and train
# the cnn on it on the CPU (10 epochs; about 2.5 minutes on 2 cores).
#   scripts/run.sh [DB_DIR [RUN_DIR]]
#   (defaults: _data/fashion-mnist.db, _data/run; extra train flags via
#   STOKE_TRAIN_ARGS, e.g. STOKE_TRAIN_ARGS="--epochs 1")
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh build
scripts/build.sh
db=${1:-_data/fashion-mnist.db}
mkdir -p "$(dirname "$db")"
build/bin/prep --force /usr/share/datasets/fashion-mnist "$db"
build/bin/dbinfo "$db" --grid "${db%/}.png"
run=${2:-_data/run}
# a second run of this script continues (or reports) the first one
resume=()
ls "$run"/checkpoints/step-* >/dev/null 2>&1 && resume=(--resume auto)
# shellcheck disable=SC2086
build/bin/train --db "$db" --model cnn --out "$run" "${resume[@]}" ${STOKE_TRAIN_ARGS:-}
