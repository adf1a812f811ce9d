#!/usr/bin/env bash
# The main job on the built-in default: build stoke, prepare Fashion-MNIST
# (Debian's dataset-fashion-mnist) into an LMDB database, and show it.
#   scripts/run.sh [DB_DIR]     (default: _data/fashion-mnist.db)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh build
scripts/build.sh
db=${1:-_data/fashion-mnist.db}
mkdir -p "$(dirname "$db")"
build/bin/prep --force /usr/share/datasets/fashion-mnist "$db"
build/bin/dbinfo "$db" --grid "${db%/}.png"
