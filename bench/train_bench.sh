#!/usr/bin/env bash
# train_bench.sh - stoke's CPU training side by side with PyTorch (issue 4),
# in one run on this machine:
#
# - Fashion-MNIST train split (60000 x 1x28x28 uint8, a stoke database made
#   by `prep`), models cnn at batch 128, mlp at batch 256 (issue 4) and
#   resnet20 at batch 128 (issue 14), 1 and 2 threads, SGD with momentum 0.9
#   (lr 0.02, no weight decay) in both, dropout on (cnn, mlp).
#   stoke:   `train --db FM --model M --batch B --threads T --workers W
#             --optim sgd --epochs 1000 --max-steps N --log-every K --quiet`
#            with W = 1 (the numbers the targets use) and W = 2 (not for
#            resnet20, which waits for no batch); N is chosen
#            for about SECONDS s of steps (from the rate of the last run of
#            the same configuration). Samples/s and data stall come from
#            RUN/metrics.jsonl (bench/train_peers.py stoke): the first 2 log
#            windows (2 K steps) are left out.
#   PyTorch: bench/train_peers.py torch: tests/e2e/torch_ref.py's module,
#            the split in memory as a uint8 tensor, each batch gathered and
#            normalised like stoke's transform ((x / 255 - mean) / std),
#            torch.set_num_threads(T), OMP_NUM_THREADS = MKL_NUM_THREADS = T,
#            OPENBLAS_NUM_THREADS = T ("torch") and, at T = 2, also
#            OPENBLAS_NUM_THREADS = 1 ("torch-blas1": torch's own threads
#            around single-threaded GEMMs, which is faster here); 2 K warm-up
#            steps, then SECONDS s of steps timed. The BLAS it runs on is read
#            from its /proc/self/maps (and openblas_get_config()). With
#            OPENBLAS_NUM_THREADS = 1 it runs a second time with glibc's
#            malloc keeping freed memory (bench/malloc_keep.sh, "-keep");
#            the ratios take PyTorch's fastest setup.
# - The OpenBLAS SGEMM peak: bench/sgemm_peak.c (cc -O2 -lopenblas),
#   2048^3 cblas_sgemm at 1 and 2 threads, best of 7 calls, once per round.
# - GFLOP/s of a training step = analytic conv/linear FLOPs of a forward pass
#   x 3 x samples/s (bench/train_peers.py flops).
# - Peak memory (each round, 1 thread, --workers 1, glibc's malloc as is):
#   each tool trains the same number of samples (MEM_SAMPLES) at the
#   model's batch and at batch MEM_SMALL; ru_maxrss of the process (stoke:
#   /usr/bin/time -f %M, PyTorch: resource.getrusage at its end); per sample =
#   the difference of the peaks / the difference of the batches.
# train is copied to WORK_DIR first (a rebuild of build/ meanwhile cannot mix
# binaries). Every (configuration, tool) runs in a fresh process, REPS rounds, the order
# rotating each round so that noise hits every tool alike; the tables show
# medians. When a target is missed, `perf record -g` profiles stoke's train
# in each configuration (PROFILE_SECONDS s each) and the report lists the
# functions where its time goes.
#
# usage: bench/train_bench.sh [WORK_DIR]    (default /tmp/stoke-train-bench)
# environment: MODELS (default "cnn mlp resnet20"; MODELS=resnet20 runs only
#   issue 14's part), REPS (default 3), SECONDS_PER_RUN (timed seconds per run,
#   default 8), MEM_SMALL (default 16), MEM_SAMPLES (default 512), PROFILE
#   (1: profile the models with a missed target (default), 0: never,
#   2: always), PROFILE_SECONDS (default 6), PREP, TRAIN
#   (binaries, default build/bin/*, built when missing), IDX_DIR (default
#   /usr/share/datasets/fashion-mnist).
# Raw results go to WORK_DIR/results.jsonl, the report (markdown) to stdout
# and WORK_DIR/report.md.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BENCH=$ROOT/bench
WORK=${1:-/tmp/stoke-train-bench}
MODELS=${MODELS:-cnn mlp resnet20}
REPS=${REPS:-3}
SECS=${SECONDS_PER_RUN:-8}
MEM_SMALL=${MEM_SMALL:-16}
MEM_SAMPLES=${MEM_SAMPLES:-512}
PROFILE=${PROFILE:-1}
PROFILE_SECONDS=${PROFILE_SECONDS:-6}
IDX_DIR=${IDX_DIR:-/usr/share/datasets/fashion-mnist}
PREP=${PREP:-$ROOT/build/bin/prep}
TRAIN=${TRAIN:-$ROOT/build/bin/train}
PY=/usr/bin/python3 # Debian's interpreter, with python3-{torch,numpy,lmdb}
PEERS=$BENCH/train_peers.py

die() { echo "train_bench: $*" >&2; exit 1; }
say() { echo "train_bench: $*" >&2; }

if [ ! -x "$PREP" ] || [ ! -x "$TRAIN" ]; then
    "$ROOT/scripts/build.sh" >&2
fi
{ [ -x "$PREP" ] && [ -x "$TRAIN" ]; } || die "no prep/train binaries in $ROOT/build/bin"
"$PY" -c 'import torch, numpy, lmdb' 2>/dev/null ||
    die "$PY lacks torch/numpy/lmdb: apt-get install -y python3-torch python3-numpy python3-lmdb"

mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
FM=$WORK/fm-stoke
RESULTS=$WORK/results.jsonl
PEAK=$WORK/sgemm_peak
RUN=$WORK/run
start=$EPOCHREALTIME
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

# ------------------------------------------------------------ preparation
# a private copy of train, so that a rebuild of build/ during the run cannot
# mix two binaries in one set of results
train_info="$(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo '?'), binary of $(date -u -r "$TRAIN" '+%F %T UTC')"
cp "$TRAIN" "$WORK/train"
TRAIN_SRC=$TRAIN
TRAIN=$WORK/train
cc -O2 -Wall -o "$PEAK" "$BENCH/sgemm_peak.c" -lopenblas
[ -d "$FM" ] || "$PREP" --quiet "$IDX_DIR" "$FM" >&2
cat "$FM/data.mdb" >/dev/null
# which BLAS the system's alternative gives libblas.so.3 users (PyTorch)
alt=$(update-alternatives --query libblas.so.3-x86_64-linux-gnu 2>/dev/null |
    awk '/^Value:/ { print $2 }')
case "$alt" in
*openblas*) ;;
*) say "libblas.so.3 -> $alt is not OpenBLAS: PyTorch would run on it;" \
    "switch with: update-alternatives --set libblas.so.3-x86_64-linux-gnu" \
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3" ;;
esac

declare -A RATE=([cnn1]=1300 [cnn2]=2500 [mlp1]=42000 [mlp2]=50000 [resnet201]=80
    [resnet202]=150)
# resnet20 logs every step: a step takes a second or more
declare -A BATCH=([cnn]=128 [mlp]=256 [resnet20]=128) LOGK=([cnn]=10 [mlp]=25 [resnet20]=1)
for m in $MODELS; do [ -n "${BATCH[$m]:-}" ] || die "MODELS: no model $m (cnn, mlp, resnet20)"; done

add() { # json, then key=value pairs (numbers or strings) -> a line of RESULTS
    "$PY" -c '
import json, sys
d = json.loads(sys.argv[1])
for kv in sys.argv[2:]:
    k, v = kv.split("=", 1)
    try:
        v = int(v)
    except ValueError:
        pass
    d[k] = v
print(json.dumps(d))' "$@" >>"$RESULTS"
}

run_stoke() { # rep model threads workers
    local rep=$1 m=$2 t=$3 w=$4 b=${BATCH[$2]} k=${LOGK[$2]} steps line
    steps=$("$PY" -c "import math; print(2 * $k + math.ceil($SECS * ${RATE[$m$t]} / $b))")
    rm -rf "$RUN"
    OPENBLAS_NUM_THREADS=$t "$TRAIN" --db "$FM" --model "$m" --batch "$b" --threads "$t" \
        --workers "$w" --optim sgd --epochs 1000 --max-steps "$steps" --log-every "$k" \
        --seed "$rep" --out "$RUN" --quiet >/dev/null 2>"$WORK/train.err" ||
        die "train failed: $(cat "$WORK/train.err")"
    line=$("$PY" "$PEERS" stoke "$RUN" "$b" $((2 * k))) || die "metrics of $m $t $w"
    add "$line" model="$m" threads="$t" workers="$w" batch="$b" rep="$rep" max_steps="$steps"
    [ "$w" = 1 ] && RATE[$m$t]=$("$PY" -c 'import json, sys; print(int(json.loads(sys.argv[1])["samples_per_s"]))' "$line")
    say "rep $rep $m T=$t stoke W=$w: $(tail -n1 "$RESULTS" | "$PY" -c 'import json, sys; d = json.load(sys.stdin); print("%.0f samples/s, stall %.2f%%, %.1f s" % (d["samples_per_s"], 100 * d["stall"], d["seconds"]))')"
}

. "$BENCH/malloc_keep.sh" # KEEP: glibc keeps what PyTorch frees

run_torch() { # rep model threads blas_threads [keep]
    local rep=$1 m=$2 t=$3 bt=$4 b=${BATCH[$2]} k=${LOGK[$2]} line env=() tag=()
    if [ "${5:-}" = keep ]; then env=("${KEEP[@]}"); fi
    line=$(env "${env[@]}" "$PY" "$PEERS" torch "$m" "$b" "$t" "$FM" --seconds "$SECS" \
        --warmup $((2 * k)) --blas-threads "$bt" --seed "$rep") || die "torch $m $t $bt ${5:-} failed"
    if [ "${5:-}" = keep ]; then tag=(tool="$("$PY" -c 'import json, sys; print(json.loads(sys.argv[1])["tool"])' "$line")-keep"); fi
    add "$line" rep="$rep" "${tag[@]}"
    say "rep $rep $m T=$t torch BLAS threads $bt ${5:-}: $(tail -n1 "$RESULTS" | "$PY" -c 'import json, sys; d = json.load(sys.stdin); print("%.0f samples/s on %s %s" % (d["samples_per_s"], d["blas_kind"], d["blas_libs"]))')"
}

run_mem() { # rep tool model batch: peak RSS over MEM_SAMPLES samples, 1 thread
    local rep=$1 tool=$2 m=$3 b=$4 steps=$((MEM_SAMPLES / $4)) line
    if [ "$tool" = stoke ]; then
        rm -rf "$RUN"
        OPENBLAS_NUM_THREADS=1 /usr/bin/time -f %M -o "$WORK/maxrss" "$TRAIN" --db "$FM" \
            --model "$m" --batch "$b" --threads 1 --workers 1 --optim sgd --epochs 1000 \
            --max-steps "$steps" --log-every "$steps" --seed "$rep" --out "$RUN" --quiet \
            >/dev/null 2>"$WORK/train.err" || die "train failed: $(cat "$WORK/train.err")"
        line=$("$PY" "$PEERS" maxrss "$WORK/maxrss")
    else
        line=$("$PY" "$PEERS" torch "$m" "$b" 1 "$FM" --steps "$steps" --warmup 0 \
            --seed "$rep") || die "torch memory $m $b failed"
    fi
    add "$line" model="$m" batch="$b" threads=1 rep="$rep" steps="$steps"
    say "rep $rep $m memory $tool batch $b: $(tail -n1 "$RESULTS" | "$PY" -c 'import json, sys; print("%.0f MiB" % (json.load(sys.stdin)["maxrss_kb"] / 1024))')"
}

run_peak() { # rep
    for t in 1 2; do
        add "$("$PEAK" --n 2048 --threads "$t" --reps 7)" tool=sgemm rep="$1"
        say "rep $1 sgemm peak T=$t: $(tail -n1 "$RESULTS" | cut -c1-80)"
    done
}

# ------------------------------------------------------------------- runs
: >"$RESULTS"
JOBS=()
for m in $MODELS; do
    JOBS+=("mem stoke $m ${BATCH[$m]}" "mem torch $m ${BATCH[$m]}" "mem stoke $m $MEM_SMALL"
        "mem torch $m $MEM_SMALL")
    for t in 1 2; do
        JOBS+=("stoke $m $t 1")
        [ "$m" = resnet20 ] || JOBS+=("stoke $m $t 2")
        JOBS+=("torch $m $t $t")
        [ "$t" = 2 ] && JOBS+=("torch $m $t 1")
        JOBS+=("torch $m $t 1 keep") # PyTorch's faster BLAS setting, malloc keeping memory
    done
done
n=${#JOBS[@]}
for ((rep = 1; rep <= REPS; rep++)); do
    run_peak "$rep"
    for ((i = 0; i < n; i++)); do
        # rotate by a third of the list each round: a configuration's tools
        # stay next to each other, their order and the round's start change
        j=$(((i + (rep - 1) * (n / 3 + 1)) % n))
        read -r -a job <<<"${JOBS[$j]}"
        set -- "${job[@]}"
        case $1 in
        stoke) run_stoke "$rep" "$2" "$3" "$4" ;;
        mem) run_mem "$rep" "$2" "$3" "$4" ;;
        *) run_torch "$rep" "${@:2}" ;;
        esac
    done
done

elapsed=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.0f", b - a }')
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
table=$("$PY" "$PEERS" report "$RESULTS")

# ---------------------------------------------------------------- profile
prof=""
for m in $MODELS; do
    # the models with a missed target (PROFILE=1) or all (PROFILE=2)
    [ "$PROFILE" = 2 ] || { [ "$PROFILE" = 1 ] && grep -q "^- $m, .*NOT met" <<<"$table"; } ||
        continue
    for t in 1 2; do
        b=${BATCH[$m]}
        steps=$("$PY" -c "import math; print(math.ceil($PROFILE_SECONDS * ${RATE[$m$t]} / $b))")
        rm -rf "$RUN"
        OPENBLAS_NUM_THREADS=$t perf record -q -g -o "$WORK/perf-$m$t.data" -- \
            "$TRAIN" --db "$FM" --model "$m" --batch "$b" --threads "$t" --workers 1 \
            --optim sgd --epochs 1000 --max-steps "$steps" --log-every 50 --out "$RUN" \
            --quiet >/dev/null 2>&1 || die "perf record failed"
        # self time per function (all threads), per thread, and in the kernel
        top=$(perf report -i "$WORK/perf-$m$t.data" --no-children -F overhead,dso,sym \
            --stdio -g none --percent-limit 1 2>/dev/null |
            awk '/^ +[0-9.]+%/ { printf "| %s | %s | %s %s |\n", $1, $2, $3, $4 }' | head -n 20)
        thr=$(perf report -i "$WORK/perf-$m$t.data" --no-children -s pid --stdio -g none \
            2>/dev/null | awk '/^ +[0-9.]+%/ && n++ < 4 { printf "%s %s, ", $2, $1 }')
        thrtop=$(perf report -i "$WORK/perf-$m$t.data" --no-children -s pid,sym --stdio \
            -g none 2>/dev/null | awk '/^ +[0-9.]+%/ && n < 4 { if (!($2 in seen)) { seen[$2] = 1; n++;
            printf "%s: %s %s %s; ", $2, $3, $4, $1 } }')
        kern=$(perf report -i "$WORK/perf-$m$t.data" --no-children -F overhead,sym --stdio \
            -g none 2>/dev/null | awk '/^ +[0-9.]+% +\[k\]/ { sub(/%/, "", $1); s += $1 }
            END { printf "%.1f%%", s }')
        prof+=$'\n'"### $m, batch $b, --threads $t --workers 1 ($steps steps)"$'\n\n'
        prof+="Samples per thread (tid:name, cpu-clock; the 4 busiest): ${thr%, }; in the kernel: $kern."
        prof+=" Each thread's biggest function: ${thrtop%; }."$'\n\n'
        prof+="| self | object | function |"$'\n'"|---:|---|---|"$'\n'"$top"$'\n'
        say "profiled $m T=$t"
    done
done

# ------------------------------------------------------------------ report
ver() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || echo '?'; }
{
cat <<EOF
Machine: $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), \
family $(awk -F: '/^cpu family/ { gsub(/ /, "", $2); print $2; exit }' /proc/cpuinfo), \
$(lscpu | awk -F: '/^Hypervisor vendor/ { gsub(/^ +/, "", $2); print $2 " guest" }'), \
$(grep -o -w -E 'avx2|avx512f' /proc/cpuinfo | sort -u | tr '\n' ' ' | sed 's/ $//')), \
$(awk '/MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo) memory, \
$(. /etc/os-release && echo "$PRETTY_NAME"), kernel $(uname -r)
Versions: $("$PY" -c 'import sys, torch, numpy; print("python %s, torch %s (python3-torch %s), numpy %s" % (sys.version.split()[0], torch.__version__, sys.argv[1], numpy.__version__))' "$(ver python3-torch)"), \
OpenBLAS $(ver libopenblas0-pthread) (libopenblas0-pthread), cc $(cc -dumpfullversion), \
stoke $train_info ($TRAIN_SRC copied to $TRAIN at the start; build type \
$(awk -F= '/^CMAKE_BUILD_TYPE:/ { print $2 }' "$ROOT/build/CMakeCache.txt" 2>/dev/null)); \
train links $(ldd "$TRAIN" | awk '/openblas/ { print $3 }')
libblas.so.3 alternative: $alt ($(update-alternatives --query libblas.so.3-x86_64-linux-gnu | awk '/^Status:/ { print $2 }') mode)
Load average (1, 5, 15 min): $load_before before, $load_after after. $elapsed s for the \
timed rounds ($REPS rounds, $SECS s timed per run; models $MODELS).

$table
EOF
if [ -n "$prof" ]; then
    printf '\n## Profile of stoke (perf record -g, self time, functions >= 1%%)\n%s' "$prof"
fi
} | tee "$WORK/report.md"
