#!/usr/bin/env bash
# python_loader_bench.sh - the stoke Python package's Loader side by side
# with PyTorch DataLoader set-ups (issue 16), in one run on this machine,
# over two datasets:
#   fm      Fashion-MNIST train (60000 x 1x28x28), `prep IDX_DIR`
#   jpeg224 COUNT JPEG files of SIDE x SIDE (bench/make_jpeg_folder.py
#           --side SIDE: Fashion-MNIST upscaled, RGB, q90) prepared with
#           `prep --size 224`: COUNT x 3x224x224 (147 KiB a sample)
# The peers read the same samples, written once from the stoke database by
# bench/python_loader_peers.py make (a pickle file per sample, one pickled
# array of the whole split, python3-lmdb), checked against it.
#
# A. Iteration, batch 256, shuffled, whole epochs for at least SECONDS s,
#    workers 0, 1, 2, 4 (bench/python_loader_peers.py iter):
#      stoke        stoke.Loader(db, workers=W): NumPy batches
#      stoke-torch  stoke.Loader(db, workers=W, as_torch=True)
#      sweep        the C loader alone (build/bin/sweep), for reference: what
#                   the Python layer costs
#      pickle, array, lmdb   DataLoader(num_workers=W, pin_memory=False)
#      dataset      the same DataLoader over stoke.open(db)["train"]
#    samples/s from before the loader is made to the last batch, and
#    samples per CPU second (the process and its DataLoader workers).
# B. Data stall inside a PyTorch training loop on fm: tests/e2e/torch_ref.py's
#    cnn, batch 128, torch.set_num_threads(2), WARMUP steps then STEPS
#    timed (python_loader_peers.py train); stall = time in next() / step
#    time. TRAIN lists the loaders as TOOL:WORKERS: by default stoke-torch
#    at its default (2 here) and 0 workers, the best DataLoader of part A
#    (array, 0 workers) and the DataLoaders at 2 workers, and "memory"
#    (no loader: batches gathered from a tensor in the loop) for the step
#    time without a loader.
# C. Import to first batch: a fresh `/usr/bin/python3 -c` process timing
#    from before `import stoke` to the first batch in hand (Loader
#    defaults, batch 256), FIRST runs per configuration; the same with
#    as_torch=True (import torch included), DataLoader over lmdb and over
#    pickle files (workers 0, import torch included), `import numpy`
#    alone, and stoke after an untimed `import numpy` (as in a PyTorch
#    program, where torch has imported it), for reference.
# Every configuration runs in a fresh process; repetitions are interleaved
# (repetition > dataset > workers > tool, the tool order rotating each
# time) so that noise hits every tool alike; the tables show the median and
# the range (min-max). The 1-minute load average is recorded with every run.
#
# usage: bench/python_loader_bench.sh [WORK_DIR]  (default /tmp/stoke-pyloader-bench)
# environment: REPS (rounds of A and B, default 3), SECONDS (part A's
#   seconds per run, default 2), STEPS (default 200), WARMUP (default 20),
#   TRAIN (part B's TOOL:WORKERS list, see above), FIRST (part C's runs per
#   configuration, default 7), PARTS (default "A B C"), DATA (parts A and
#   C's datasets, default "fm jpeg224"), COUNT (JPEG files, default 4000),
#   SIDE (their side, default 256), IDX_DIR (default
#   /usr/share/datasets/fashion-mnist), BUILD (default build: prep, sweep and
#   python/stoke are taken from there, built when missing).
# The datasets are made once under WORK_DIR and kept; raw results go to
# WORK_DIR/results.jsonl, the report (markdown) to stdout and
# WORK_DIR/report.md.
set -euo pipefail

SECS=$SECONDS # bash's own SECONDS starts at the value the environment gives
[ "$SECS" -gt 0 ] || SECS=2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BENCH=$ROOT/bench
WORK=${1:-/tmp/stoke-pyloader-bench}
REPS=${REPS:-3}
STEPS=${STEPS:-200}
WARMUP=${WARMUP:-20}
TRAIN=${TRAIN:-memory:0 stoke-torch:2 stoke-torch:0 array:0 array:2 pickle:2 lmdb:2}
FIRST=${FIRST:-7}
PARTS=${PARTS:-A B C}
COUNT=${COUNT:-4000}
SIDE=${SIDE:-256}
IDX_DIR=${IDX_DIR:-/usr/share/datasets/fashion-mnist}
BUILD=${BUILD:-$ROOT/build}
PREP=$BUILD/bin/prep
SWEEP=$BUILD/bin/sweep
PY=/usr/bin/python3 # Debian's interpreter, with python3-{torch,numpy,lmdb,pil}
PEERS=$BENCH/python_loader_peers.py
WORKERS=(0 1 2 4)
TOOLS=(stoke stoke-torch sweep pickle array lmdb dataset)

die() { echo "python_loader_bench: $*" >&2; exit 1; }
say() { echo "python_loader_bench: $*" >&2; }

if ! ls "$BUILD"/python/stoke/_stoke*.so >/dev/null 2>&1 || [ ! -x "$PREP" ] || [ ! -x "$SWEEP" ]; then
    "$ROOT/scripts/build.sh" >&2
fi
ls "$BUILD"/python/stoke/_stoke*.so >/dev/null 2>&1 ||
    die "no stoke package in $BUILD/python (python3-dev missing?)"
"$PY" -c 'import torch, numpy, lmdb, PIL' 2>/dev/null ||
    die "$PY lacks torch/numpy/lmdb/PIL: apt-get install -y python3-torch python3-numpy python3-lmdb python3-pil"
export PYTHONPATH=$BUILD/python

mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
JPEG=$WORK/jpeg$SIDE-$COUNT
RESULTS=$WORK/results.jsonl
TMPJSON=$WORK/sweep.json
start=$EPOCHREALTIME
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

# ------------------------------------------------------------ preparation
declare -A DB PEER
DB[fm]=$WORK/fm
DB[jpeg224]=$WORK/db224-jpeg$SIDE-$COUNT
for d in fm jpeg224; do PEER[$d]=$WORK/peers-$(basename "${DB[$d]}"); done
read -r -a DATA <<<"${DATA:-fm jpeg224}"
[ -d "${DB[fm]}" ] || "$PREP" --quiet "$IDX_DIR" "${DB[fm]}" >&2
[ -d "$JPEG" ] || "$PY" "$BENCH/make_jpeg_folder.py" "$JPEG" "$COUNT" --side "$SIDE" --idx-dir "$IDX_DIR" >&2
[ -d "${DB[jpeg224]}" ] || "$PREP" --quiet --size 224 "$JPEG" "${DB[jpeg224]}" >&2
checks=()
for d in fm jpeg224; do
    mkdir -p "${PEER[$d]}"
    "$PY" "$PEERS" make "${DB[$d]}" "${PEER[$d]}"
    checks+=("$d: $("$PY" "$PEERS" check "${DB[$d]}" "${PEER[$d]}")") || die "peers of $d differ"
done

warm() { # every input in the page cache
    local d=$1
    cat "${DB[$d]}/data.mdb" "${PEER[$d]}/peer-lmdb/data.mdb" "${PEER[$d]}/peer-array.pkl" >/dev/null
    find "${PEER[$d]}/peer-pkl/train" -type f -print0 | xargs -0 cat >/dev/null
}

# record PART DATA REP JSON: one line of RESULTS, with the load average
record() {
    "$PY" -c 'import json, sys; d = json.loads(sys.argv[4]); d.update(part=sys.argv[1], data=sys.argv[2], rep=int(sys.argv[3]), load1=float(sys.argv[5])); print(json.dumps(d))' \
        "$@" "$(cut -d' ' -f1 /proc/loadavg)" >>"$RESULTS"
}

# ---------------------------------------------------------- A: iteration
run_a() { # rep data workers tool
    local rep=$1 d=$2 w=$3 tool=$4 line epochs
    if [ "$tool" = sweep ]; then
        # about SECONDS s: the C loader runs a fixed number of epochs
        epochs=$([ "$d" = fm ] && echo $((20 * SECS)) || echo $((3 * SECS)))
        "$SWEEP" --db "${DB[$d]}" --workers "$w" --batch 256 --epochs "$epochs" --json "$TMPJSON" >/dev/null ||
            die "sweep failed"
        line=$("$PY" -c 'import json, sys; d = json.load(open(sys.argv[1])); r = d["results"][0]; print(json.dumps({"tool": "sweep", "workers": r["workers"], "samples_per_s": r["samples_per_s"], "first_batch_s": r["first_batch_s"], "elapsed_s": r["elapsed_s"], "epochs": d["epochs"], "stall": r["stall"]}))' "$TMPJSON")
    else
        line=$("$PY" "$PEERS" iter "$tool" "$w" "${DB[$d]}" "${PEER[$d]}" --batch 256 \
            --seconds "$SECS" --seed "$rep") || die "iter $tool $w on $d failed"
    fi
    record A "$d" "$rep" "$line"
    "$PY" -c 'import json, sys; d = json.loads(sys.argv[1]); print("python_loader_bench: A rep %d %-7s workers %d %-11s %9.0f samples/s  first batch %7.1f ms  load %.2f" % (d["rep"], d["data"], d["workers"], d["tool"], d["samples_per_s"], 1e3 * d["first_batch_s"], d["load1"]), file=sys.stderr)' "$(tail -n1 "$RESULTS")"
}

# ------------------------------------------------------ B: training stall
run_b() { # rep tool workers
    local line
    line=$("$PY" "$PEERS" train "$2" "$3" "${DB[fm]}" "${PEER[fm]}" --batch 128 --threads 2 \
        --steps "$STEPS" --warmup "$WARMUP" --seed "$1") || die "train $2 $3 failed"
    record B fm "$1" "$line"
    "$PY" -c 'import json, sys; d = json.loads(sys.argv[1]); print("python_loader_bench: B rep %d %-11s workers %d stall %6.2f%%  step %6.1f ms  load %.2f" % (d["rep"], d["tool"], d["workers"], 100 * d["stall"], 1e3 * d["step_s"], d["load1"]), file=sys.stderr)' "$(tail -n1 "$RESULTS")"
}

# ------------------------------------------------------- C: first batch
run_c() { # rep data tool workers
    local line
    line=$("$PY" "$PEERS" first "$3" "$4" "${DB[$2]}" "${PEER[$2]}" --batch 256) ||
        die "first $3 on $2 failed"
    record C "$2" "$1" "$line"
}

: >"$RESULTS"
# shellcheck disable=SC2086 # PARTS and TRAIN are word lists
for part in $PARTS; do
    case $part in
    A)
        for ((rep = 1; rep <= REPS; rep++)); do
            for d in "${DATA[@]}"; do
                warm "$d"
                for w in "${WORKERS[@]}"; do
                    for ((i = 0; i < ${#TOOLS[@]}; i++)); do
                        run_a "$rep" "$d" "$w" "${TOOLS[(i + rep + w) % ${#TOOLS[@]}]}"
                    done
                done
            done
        done
        ;;
    B)
        configs=()
        for c in $TRAIN; do configs+=("${c%:*} ${c#*:}"); done
        for ((rep = 1; rep <= REPS; rep++)); do
            warm fm
            for ((i = 0; i < ${#configs[@]}; i++)); do
                run_b "$rep" ${configs[(i + rep) % ${#configs[@]}]}
            done
        done
        ;;
    C)
        configs=("stoke -1" "stoke-numpy -1" "numpy 0" "stoke-torch -1" "lmdb 0" "pickle 0")
        for ((rep = 1; rep <= FIRST; rep++)); do
            for d in "${DATA[@]}"; do
                for ((i = 0; i < ${#configs[@]}; i++)); do
                    run_c "$rep" "$d" ${configs[(i + rep) % ${#configs[@]}]}
                done
            done
            say "C rep $rep done (load $(cut -d' ' -f1 /proc/loadavg))"
        done
        ;;
    *) die "PARTS: A, B or C, not $part" ;;
    esac
done
rm -f "$TMPJSON"

elapsed=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.0f", b - a }')
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

# ------------------------------------------------------------------ report
{
cat <<EOF
Machine: $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')), \
$(awk '/MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo) memory, kernel $(uname -r)
Versions: $("$PY" -c 'import sys, torch, numpy, lmdb; print("python %s, torch %s, numpy %s, python3-lmdb %s" % (sys.version.split()[0], torch.__version__, numpy.__version__, lmdb.__version__))'), \
stoke $(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo '?') (build type $(awk -F= '/^CMAKE_BUILD_TYPE:/ { print $2 }' "$BUILD/CMakeCache.txt" 2>/dev/null))
Run: $(date -u '+%Y-%m-%d %H:%M') UTC (end), $elapsed s; REPS=$REPS SECONDS=$SECS STEPS=$STEPS WARMUP=$WARMUP FIRST=$FIRST PARTS="$PARTS"
Load average (1, 5, 15 min): $load_before before, $load_after after.
Data: ${checks[*]}
EOF
"$PY" "$PEERS" report "$RESULTS"
} | tee "$WORK/report.md"
