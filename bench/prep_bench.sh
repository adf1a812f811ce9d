#!/usr/bin/env bash
# prep_bench.sh - `prep` side by side with the common Python ways of turning a
# raw dataset into something a trainer reads:
#   prep          stoke's prep (threads, LMDB)
#   pool+pickle   multiprocessing.Pool, one pickle file per sample
#   pool+lmdb     multiprocessing.Pool decodes, imap (ordered, chunksize 64),
#                 the parent writes pickled (array, label) values to LMDB
# on two datasets:
#   idx           Fashion-MNIST, train+test (70000 samples) from the IDX .gz files
#   folder        COUNT (default 20000) JPEG files made from Fashion-MNIST
#                 (64x64 RGB, quality 90), prepared to 3x32x32
#                 (prep --size 32 --rgb; the peers do the same with PIL)
# with 1 and 2 workers each.
#
# usage: bench/prep_bench.sh [WORK_DIR]        (default /tmp/stoke-bench)
# environment: REPS (runs per configuration, default 5; the table shows the
#              median), COUNT (JPEG files, default 20000), PREP (the prep
#              binary, default build/bin/prep, built when missing), IDX_DIR
#              (default /usr/share/datasets/fashion-mnist).
#
# Every run is timed from outside, wall clock from the start of the process
# to its exit (each tool's own fsync/commit included), with the inputs in the
# page cache and no dirty pages left by earlier runs (`sync` before each run).
# Runs are interleaved (repetition > dataset > workers > tool, the tool order
# rotating every repetition) so that noise hits every tool alike. After each
# run the output is checked (sample count and shape) so that no tool is timed
# doing less work, then moved aside into WORK_DIR/trash, which is deleted only
# after the last timed run: this machine's ext4 has no journal, and there
# creating files shortly (< 60 s) after deleting many makes the inode
# allocator skip every recently deleted inode, which would slow down the
# pickle-per-sample peer by up to 4x depending on what ran before it.
# Everything is written under WORK_DIR; the raw results are kept in
# WORK_DIR/results.tsv and the tools' own output in WORK_DIR/logs/.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BENCH=$ROOT/bench
WORK=${1:-/tmp/stoke-bench}
REPS=${REPS:-5}
COUNT=${COUNT:-20000}
IDX_DIR=${IDX_DIR:-/usr/share/datasets/fashion-mnist}
PREP=${PREP:-$ROOT/build/bin/prep}
PY=/usr/bin/python3 # the Debian interpreter, with python3-{numpy,pil,lmdb}
IDX_COUNT=70000

die() { echo "prep_bench: $*" >&2; exit 1; }

[ -x "$PREP" ] || "$ROOT/scripts/build.sh" >&2
[ -x "$PREP" ] || die "no prep binary at $PREP"
"$PY" -c 'import numpy, PIL, lmdb' 2>/dev/null ||
    die "$PY lacks numpy/PIL/lmdb: apt-get install -y python3-numpy python3-pil python3-lmdb"
for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
    [ -f "$IDX_DIR/$f.gz" ] || die "missing $IDX_DIR/$f.gz (Debian package dataset-fashion-mnist)"
done

mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
JPEG=$WORK/jpeg-$COUNT
OUT=$WORK/out
TRASH=$WORK/trash
LOGS=$WORK/logs
RESULTS=$WORK/results.tsv

if [ ! -d "$JPEG" ]; then
    echo "prep_bench: making $JPEG" >&2
    "$PY" "$BENCH/make_jpeg_folder.py" "$JPEG" "$COUNT" --idx-dir "$IDX_DIR" >&2
fi
[ "$(find "$JPEG" -name '*.jpg' | wc -l)" -eq "$COUNT" ] || die "$JPEG does not hold $COUNT files"

# Leftovers of an earlier run: delete them, then give ext4 its 60 s so that
# the freed inodes do not slow down the first file-creating runs.
if [ -e "$OUT" ] || [ -e "$TRASH" ]; then
    echo "prep_bench: removing leftovers of an earlier run, then waiting 61 s (see the header)" >&2
    rm -rf "$OUT" "$TRASH"
    sync
    sleep 61
fi
rm -rf "$LOGS"
mkdir -p "$TRASH" "$LOGS"
printf 'rep\tdataset\tworkers\ttool\tseconds\tsamples\n' >"$RESULTS"

warm() { # reads a dataset's input files so that every run finds them cached
    if [ "$1" = idx ]; then
        cat "$IDX_DIR"/*-ubyte.gz >/dev/null
    else
        find "$JPEG" -type f -print0 | xargs -0 cat >/dev/null
    fi
}

run_one() { # rep dataset workers tool
    local rep=$1 ds=$2 w=$3 tool=$4 src expect kind cmd
    if [ "$ds" = idx ]; then src=$IDX_DIR expect=$IDX_COUNT; else src=$JPEG expect=$COUNT; fi
    case $tool in
    prep)
        kind=prep
        if [ "$ds" = idx ]; then
            cmd=("$PREP" --quiet --workers "$w" "$src" "$OUT")
        else
            cmd=("$PREP" --quiet --workers "$w" --size 32 --rgb "$src" "$OUT")
        fi ;;
    pool+pickle) kind=pickle cmd=("$PY" "$BENCH/prep_peers.py" pickle "$ds" "$w" "$src" "$OUT") ;;
    pool+lmdb) kind=lmdb cmd=("$PY" "$BENCH/prep_peers.py" lmdb "$ds" "$w" "$src" "$OUT") ;;
    esac
    [ ! -e "$OUT" ] || mv "$OUT" "$TRASH/$(date +%s%N)"
    warm "$ds"
    sync
    local log=$LOGS/$rep-$ds-$w-$tool.log t0 t1
    t0=$EPOCHREALTIME
    "${cmd[@]}" >"$log" 2>&1 || { cat "$log" >&2; die "failed: ${cmd[*]}"; }
    t1=$EPOCHREALTIME
    local check n
    check=$("$PY" "$BENCH/check_output.py" count "$kind" "$OUT") || die "bad output of ${cmd[*]}"
    echo "$check" >>"$log"
    n=${check#samples=}
    n=${n%% *}
    [ "$n" -eq "$expect" ] || die "${cmd[*]} wrote $n samples, expected $expect"
    local secs
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.4f", b - a }')
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$rep" "$ds" "$w" "$tool" "$secs" "$n" >>"$RESULTS"
    printf 'prep_bench: rep %s %-6s workers %s %-11s %7.3f s %8.0f samples/s\n' \
        "$rep" "$ds" "$w" "$tool" "$secs" "$(awk -v n="$n" -v s="$secs" 'BEGIN { print n / s }')" >&2
}

TOOLS=(prep pool+pickle pool+lmdb)
load0=$(cut -d' ' -f1-3 /proc/loadavg)
start=$EPOCHREALTIME
for ((rep = 1; rep <= REPS; rep++)); do
    for ds in idx folder; do
        for w in 1 2; do
            for ((i = 0; i < 3; i++)); do # rotate the tool order every repetition
                run_one "$rep" "$ds" "$w" "${TOOLS[(i + rep - 1) % 3]}"
            done
        done
    done
done
elapsed=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.0f", b - a }')
load1=$(cut -d' ' -f1-3 /proc/loadavg)

# Same pixels and labels as the Python peers (checked once, untimed).
[ ! -e "$OUT" ] || mv "$OUT" "$TRASH/$(date +%s%N)"
"$PREP" --quiet --workers 2 --size 32 --rgb "$JPEG" "$WORK/check-prep" >/dev/null
"$PY" "$BENCH/prep_peers.py" lmdb folder 2 "$JPEG" "$WORK/check-peer" >/dev/null
same=$("$PY" "$BENCH/check_output.py" compare "$WORK/check-prep" "$WORK/check-peer" || true)
rm -rf "$WORK/check-prep" "$WORK/check-peer" "$TRASH"

# ------------------------------------------------------------------ report
ver() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || echo '?'; }
cat <<EOF
Machine: $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')), \
$(awk '/MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo) memory, \
$(. /etc/os-release && echo "$PRETTY_NAME"), kernel $(uname -r), $(df -T "$WORK" | awk 'NR == 2 { print $2 }') at $WORK
Versions: $("$PY" -c 'import sys, PIL, numpy, lmdb; print("python %s, Pillow %s, numpy %s, python3-lmdb %s (liblmdb %s)" % (sys.version.split()[0], PIL.__version__, numpy.__version__, lmdb.__version__, ".".join(map(str, lmdb.version()))))'), \
libjpeg-turbo $(ver libjpeg62-turbo) (libturbojpeg $(ver libturbojpeg0)), \
stoke $(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo '?')
Runs: $REPS per configuration, interleaved, median shown; $elapsed s in all; load average $load0 before, $load1 after.
Output check: $same

EOF
"$PY" - "$RESULTS" "$REPS" <<'EOF'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
reps = sys.argv[2]
rate = {}
for r in rows:
    rate.setdefault((r["dataset"], int(r["workers"]), r["tool"]), []).append(
        int(r["samples"]) / float(r["seconds"]))
med = {k: statistics.median(v) for k, v in rate.items()}
tools = ["prep", "pool+pickle", "pool+lmdb"]
names = {"idx": "Fashion-MNIST IDX (70000, 1x28x28)",
         "folder": "JPEG folder (%d, 64x64 -> 3x32x32)"}
count = {r["dataset"]: int(r["samples"]) for r in rows}
names["folder"] %= count["folder"]

print("samples/s, median of %s (min-max):\n" % reps)
print("| dataset | workers | prep | pool+pickle | pool+lmdb | prep / pickle | prep / lmdb |")
print("|---|---:|---:|---:|---:|---:|---:|")
for ds in ("idx", "folder"):
    for w in (1, 2):
        cells = ["%.0f (%.0f-%.0f)" % (med[ds, w, t], min(rate[ds, w, t]), max(rate[ds, w, t]))
                 for t in tools]
        print("| %s | %d | %s | %.1fx | %.1fx |" % (
            names[ds], w, " | ".join(cells),
            med[ds, w, "prep"] / med[ds, w, "pool+pickle"],
            med[ds, w, "prep"] / med[ds, w, "pool+lmdb"]))
print("\nSpeed-up from 1 to 2 workers (median 2 / median 1):\n")
print("| dataset | prep | pool+pickle | pool+lmdb |")
print("|---|---:|---:|---:|")
for ds in ("idx", "folder"):
    print("| %s | %s |" % (names[ds], " | ".join(
        "%.2fx" % (med[ds, 2, t] / med[ds, 1, t]) for t in tools)))
print("\nTargets (JPEG folder):\n")
for w in (1, 2):
    r = med["folder", w, "prep"] / med["folder", w, "pool+pickle"]
    print("- prep >= 10x pool+pickle at %d worker%s: %.1fx, %s" % (
        w, "s" if w > 1 else "", r, "met" if r >= 10 else "NOT met"))
s = med["folder", 2, "prep"] / med["folder", 1, "prep"]
print("- prep speed-up 1 -> 2 workers >= 1.7x: %.2fx, %s" % (s, "met" if s >= 1.7 else "NOT met"))
EOF
