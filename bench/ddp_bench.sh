#!/usr/bin/env bash
# ddp_bench.sh [WORK_DIR] - data-parallel training on the CPU, side by side
# (issue 5): stoke `train --nproc 2` (shared-memory collectives) against
# PyTorch DistributedDataParallel over gloo, 2 processes of 1 thread each,
# the cnn at batch 64 per rank, SGD(lr 0.02, momentum 0.9), the same
# Fashion-MNIST train split; and each tool with 1 process of 1 thread, for
# the scaling from 1 to 2 processes. MODEL=resnet20 (issue 14) runs the
# same for resnet20 at batch 128 per rank (BATCH sets another), logging every
# step and leaving out the first 2 (its steps are 50x longer).
#
#   stoke:   train --db FM --model MODEL --batch B --threads 1 --workers 1
#            --optim sgd [--nproc 2] --max-steps N --log-every 10 --quiet
#            (samples/s from rank 0's step times, the first 20 steps left
#            out; the hidden share of the all-reduce from the step lines)
#   PyTorch: bench/ddp_peer.py FM --model MODEL --world W --batch B
#            --threads 1, as is
#            and with glibc's malloc keeping freed memory (MALLOC_*_ below)
# REPS rounds (default 3), the order rotating each round; SECONDS_PER_RUN
# (default 8) of timed steps per run; TRAIN, PREP: the binaries (default
# build/bin/*). Results: WORK_DIR/results.jsonl and
# WORK_DIR/report.md.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-/tmp/stoke-ddp-bench}
REPS=${REPS:-3}
SECS=${SECONDS_PER_RUN:-8}
MODEL=${MODEL:-cnn}
PY=/usr/bin/python3
case $MODEL in
cnn) B=${BATCH:-64} LOGK=10 ;;
resnet20) B=${BATCH:-128} LOGK=1 ;;
*) echo "ddp_bench: MODEL: cnn or resnet20, not $MODEL" >&2; exit 2 ;;
esac
mkdir -p "$WORK"
RESULTS=$WORK/results.jsonl
: >"$RESULTS"
say() { echo "ddp_bench: $*" >&2; }
TRAIN=${TRAIN:-$ROOT/build/bin/train} PREP=${PREP:-$ROOT/build/bin/prep}
[ -x "$TRAIN" ] || cmake --build "$ROOT/build" -j2
cp "$TRAIN" "$WORK/train" # a rebuild meanwhile cannot mix binaries
cp "$PREP" "$WORK/prep"
FM=$WORK/fm
[ -d "$FM" ] || "$WORK/prep" --quiet /usr/share/datasets/fashion-mnist "$FM"

declare -A RATE=([1]=2500 [2]=4500) # samples/s guesses, refined by each run
[ "$MODEL" = cnn ] || RATE=([1]=80 [2]=150)
run_stoke() { # rep world
  local rep=$1 w=$2 steps run=$WORK/run
  steps=$($PY -c "print(2 * $LOGK + int($SECS * ${RATE[$w]} / $B / $w))")
  rm -rf "$run"
  local dist=()
  [ "$w" = 1 ] || dist=(--nproc "$w")
  "$WORK/train" --db "$FM" --model "$MODEL" --batch "$B" --threads 1 --workers 1 --optim sgd \
    --epochs 1000 --max-steps "$steps" --log-every "$LOGK" --seed "$rep" --out "$run" --quiet \
    "${dist[@]}" >"$WORK/train.out" 2>&1 || { cat "$WORK/train.out"; exit 1; }
  local line
  line=$($PY "$ROOT/bench/ddp_peer.py" stoke "$run" $((2 * LOGK)) "$B")
  echo "$line" | $PY -c "import json, sys; d = json.load(sys.stdin); d['rep'] = $rep; d['model'] = '$MODEL'; print(json.dumps(d))" >>"$RESULTS"
  RATE[$w]=$(echo "$line" | $PY -c 'import json, sys; print(int(json.load(sys.stdin)["samples_per_s"]))')
  say "rep $rep stoke $w x 1: $(tail -n1 "$RESULTS")"
}
run_torch() { # rep world [malloc env...]
  local rep=$1 w=$2 line tool=torch-ddp-gloo
  shift 2
  [ $# = 0 ] || tool=torch-ddp-gloo-keep
  line=$(env "$@" $PY "$ROOT/bench/ddp_peer.py" "$FM" --model "$MODEL" --world "$w" \
    --batch "$B" --threads 1 --seconds "$SECS" --warmup $((2 * LOGK)) --seed "$rep")
  echo "$line" | $PY -c "import json, sys; d = json.load(sys.stdin); d['rep'] = $rep; d['tool'] = '$tool'; print(json.dumps(d))" >>"$RESULTS"
  say "rep $rep $tool $w x 1: $(tail -n1 "$RESULTS" | cut -c1-200)"
}
. "$ROOT/bench/malloc_keep.sh" # KEEP: glibc keeps what PyTorch frees
run_keep() { run_torch "$1" "$2" "${KEEP[@]}"; }
jobs=("run_stoke 1" "run_stoke 2" "run_torch 1" "run_torch 2" "run_keep 1" "run_keep 2")
for rep in $(seq "$REPS"); do
  for k in $(seq 0 5); do
    j=${jobs[$(((k + rep) % 6))]}
    ${j%% *} "$rep" "${j##* }"
  done
done
{
  echo "Machine: $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), $(free -g | awk '/Mem/ {print $2}') GiB"
  echo "Load average (1, 5, 15 min) at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "stoke $(git -C "$ROOT" describe --always --dirty), $MODEL at batch $B per rank, $REPS rounds, $SECS s timed per run"
  echo
  $PY "$ROOT/bench/ddp_peer.py" report "$RESULTS"
} >"$WORK/report.md"
cat "$WORK/report.md"
