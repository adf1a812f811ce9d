#!/usr/bin/env bash
# photo_bench.sh - random-resized-crops from stoke's raw and JPEG records
# against torchvision's ImageFolder over the original files (issue 17), side
# by side in one run on this machine.
#
# Data: COUNT photo-sized JPEGs (bench/make_photos.py: crops of ten real
# photographs, about 500x400, quality 90, ten class folders), prepared twice
# with aspect-keeping storage (prep_db below):
#   raw   `prep --short-side 256 --max-side 512` (pixels)
#   jpeg  the same with `--encode jpeg` (JPEG records, decoded by the workers)
# Tools, each producing batches of 256 uint8 3x224x224 random-resized-crops
# (scale 0.08-1, ratio 3/4-4/3) with a random flip, shuffled, workers 1 and 2:
#   stoke-raw, stoke-jpeg  `sweep --augment rrc --crop-size 224` (stoke_sweep
#                below): EPOCHS whole epochs, timed from loader open to the
#                last batch (sweep's own figures, first batch included)
#   torch        bench/photo_peers.py time: ImageFolder + RandomResizedCrop
#                + RandomHorizontalFlip + PILToTensor in DataLoader(shuffle,
#                persistent workers), the seeds' status quo: 2 warm-up
#                batches untimed, then BATCHES timed
# Every (tool, workers) runs in a fresh process, REPS times, interleaved
# (repetition > workers > tool, the tool order rotating) so that noise hits
# every tool alike; the table shows the median and the range, and the
# ratios to torch (targets: raw >= 10x, jpeg >= 3x). Also disk bytes per
# image: the original files, each database's data.mdb over its records.
#
# usage: bench/photo_bench.sh [WORK_DIR]    (default /tmp/stoke-photo-bench)
# environment: REPS (default 3), COUNT (photos, default 4000), EPOCHS (stoke,
#   default 3), BATCHES (torch, default 16), TOOLS (default "stoke-raw
#   stoke-jpeg torch"; TOOLS=torch needs no stoke build), PREP and SWEEP
#   (binaries, default build/bin/*, built when missing).
# The photos and databases are made once under WORK_DIR and kept; raw
# results go to WORK_DIR/results.jsonl, the report (markdown) to stdout and
# WORK_DIR/report.md.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BENCH=$ROOT/bench
WORK=${1:-/tmp/stoke-photo-bench}
REPS=${REPS:-3}
COUNT=${COUNT:-4000}
EPOCHS=${EPOCHS:-3}
BATCHES=${BATCHES:-16}
PREP=${PREP:-$ROOT/build/bin/prep}
SWEEP=${SWEEP:-$ROOT/build/bin/sweep}
PY=/usr/bin/python3 # Debian's interpreter, with python3-{torch,torchvision,pil,lmdb}
read -r -a TOOLS <<<"${TOOLS:-stoke-raw stoke-jpeg torch}"
WORKERS=(1 2)
BATCH=256
CROP=224

die() { echo "photo_bench: $*" >&2; exit 1; }
say() { echo "photo_bench: $*" >&2; }

# The two places that know the flags of issue 17's other parts: fix them
# here if their interface differs.
prep_db() { # SRC DST [extra prep flags]
    local src=$1 dst=$2
    shift 2
    "$PREP" --quiet --short-side 256 --max-side 512 "$@" "$src" "$dst" >&2
}
stoke_sweep() { # DB WORKERS SEED: sweep's JSON into TMPJSON
    "$SWEEP" --db "$1" --workers "$2" --batch $BATCH --epochs "$EPOCHS" --seed "$3" \
        --augment rrc --crop-size $CROP --json "$TMPJSON" >/dev/null
}

stoke=0
case " ${TOOLS[*]} " in *" stoke-"*) stoke=1 ;; esac
if [ $stoke = 1 ]; then
    if [ ! -x "$PREP" ] || [ ! -x "$SWEEP" ]; then
        "$ROOT/scripts/build.sh" >&2
    fi
    if [ ! -x "$PREP" ] || [ ! -x "$SWEEP" ]; then
        die "no prep/sweep binaries in $ROOT/build/bin"
    fi
    help="$("$PREP" --help) $("$SWEEP" --help)"
    for flag in --short-side --max-side --encode --augment --crop-size; do
        [[ $help == *"$flag"* ]] ||
            die "neither prep --help nor sweep --help lists $flag (issue 17 not merged?); TOOLS=torch runs the peer alone"
    done
fi
"$PY" -c 'import torch, torchvision, PIL, lmdb' 2>/dev/null ||
    die "$PY lacks torch/torchvision/PIL/lmdb: scripts/deps.sh bench"

mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
PHOTOS=$WORK/photos-$COUNT
RAW=$WORK/raw-$COUNT
JPEG=$WORK/jpeg-$COUNT
RESULTS=$WORK/results.jsonl
TMPJSON=$WORK/sweep.json
start=$EPOCHREALTIME
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

# ------------------------------------------------------------ preparation
[ -d "$PHOTOS" ] || "$PY" "$BENCH/make_photos.py" "$PHOTOS" "$COUNT"
dbs=()
if [ $stoke = 1 ]; then
    [ -d "$RAW" ] || prep_db "$PHOTOS" "$RAW"
    [ -d "$JPEG" ] || prep_db "$PHOTOS" "$JPEG" --encode jpeg
    dbs=("$RAW" "$JPEG")
fi
: >"$RESULTS"
"$PY" "$BENCH/photo_peers.py" bytes "$PHOTOS" "${dbs[@]}" >>"$RESULTS"

warm() { # every input in the page cache
    find "$PHOTOS" -type f -print0 | xargs -0 cat >/dev/null
    for db in "${dbs[@]}"; do cat "$db/data.mdb" >/dev/null; done
}

# record REP JSON: one line of RESULTS, with the 1-minute load average
record() {
    "$PY" -c 'import json, sys; d = json.loads(sys.argv[2]); d.update(rep=int(sys.argv[1]), load1=float(sys.argv[3])); print(json.dumps(d))' \
        "$1" "$2" "$(cut -d' ' -f1 /proc/loadavg)" >>"$RESULTS"
}

run() { # rep workers tool
    local rep=$1 w=$2 tool=$3 line db
    case $tool in
    stoke-raw | stoke-jpeg)
        db=$([ "$tool" = stoke-raw ] && echo "$RAW" || echo "$JPEG")
        stoke_sweep "$db" "$w" "$rep" || die "sweep on $db failed"
        line=$("$PY" -c 'import json, sys; d = json.load(open(sys.argv[1])); r = d["results"][0]; print(json.dumps({"tool": sys.argv[2], "workers": r["workers"], "samples_per_s": r["samples_per_s"], "first_batch_s": r["first_batch_s"], "elapsed_s": r["elapsed_s"], "samples": r["samples"], "bytes_per_sample": r["bytes_per_s"] / r["samples_per_s"], "shape": d["shape"], "epochs": d["epochs"]}))' "$TMPJSON" "$tool")
        ;;
    torch)
        line=$("$PY" "$BENCH/photo_peers.py" time "$PHOTOS" "$w" --batch $BATCH --crop $CROP \
            --batches "$BATCHES" --seed "$rep") || die "photo_peers.py time $w failed"
        ;;
    *) die "TOOLS: stoke-raw, stoke-jpeg or torch, not $tool" ;;
    esac
    record "$rep" "$line"
    "$PY" -c 'import json, sys; d = json.loads(sys.argv[1]); b = d.get("bytes_per_sample"); print("photo_bench: rep %d workers %d %-10s %8.0f samples/s  first batch %6.2f s  load %.2f%s" % (d["rep"], d["workers"], d["tool"], d["samples_per_s"], d["first_batch_s"], d["load1"], "" if b is None or round(b) == 3 * 224 * 224 else "  WARNING: %.0f bytes a sample, not 3x224x224" % b), file=sys.stderr)' "$(tail -n1 "$RESULTS")"
}

for ((rep = 1; rep <= REPS; rep++)); do
    warm
    for w in "${WORKERS[@]}"; do
        for ((i = 0; i < ${#TOOLS[@]}; i++)); do
            run "$rep" "$w" "${TOOLS[(i + rep + w) % ${#TOOLS[@]}]}"
        done
    done
done
rm -f "$TMPJSON"

elapsed=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.0f", b - a }')
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

# ------------------------------------------------------------------ report
ver() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || echo '?'; }
{
cat <<EOF
Machine: $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')), \
$(awk '/MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo) memory, kernel $(uname -r), \
$(df -T "$WORK" | awk 'NR == 2 { print $2 }') at $WORK
Versions: $("$PY" -c 'import sys, torch, torchvision, PIL; print("python %s, torch %s, torchvision %s, PIL %s" % (sys.version.split()[0], torch.__version__, torchvision.__version__, PIL.__version__))'), \
libjpeg-turbo $(ver libturbojpeg0), stoke $(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo '?') \
(build type $(awk -F= '/^CMAKE_BUILD_TYPE:/ { print $2 }' "$ROOT/build/CMakeCache.txt" 2>/dev/null))
Run: $(date -u '+%Y-%m-%d %H:%M') UTC (end), $elapsed s; REPS=$REPS COUNT=$COUNT EPOCHS=$EPOCHS BATCHES=$BATCHES TOOLS="${TOOLS[*]}"
Load average (1, 5, 15 min): $load_before before, $load_after after.
EOF
"$PY" "$BENCH/photo_peers.py" report "$RESULTS"
} | tee "$WORK/report.md"
