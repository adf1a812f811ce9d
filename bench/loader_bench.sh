#!/usr/bin/env bash
# loader_bench.sh - stoke's loader side by side with the PyTorch DataLoader
# (issue 3), in one run on this machine:
#
# A. Fashion-MNIST train (60000 samples, 1x28x28 uint8), batch 256, shuffled,
#    one epoch, workers 0, 1, 2, 4:
#      stoke    `sweep --db FM --workers W --batch 256 --epochs 1 --json`
#               (threads reading LMDB zero-copy into a ring of batch buffers)
#      pickle   torch DataLoader(pin_memory=True), __getitem__ unpickles one
#               file per sample (peer-pkl/train/<i>.pkl)
#      lmdb     torch DataLoader(pin_memory=True) over python3-lmdb holding
#               pickled (array, label) values, env opened lazily per worker
#    (bench/loader_peers.py; all three read the same samples, checked once).
#    The peers are timed from iter() to the last batch, and to the first
#    batch; stoke from stk_loader_open to the end of the epoch, and to the
#    first batch (sweep's own figures). Every (tool, workers) runs in a fresh
#    process, REPS times; runs are interleaved (repetition > workers > tool,
#    the tool order rotating) so that noise hits every tool alike; tables
#    show the median.
# B. Bandwidth: bench/memcpy_bw.c (cc -O2) measures single-thread memcpy of a
#    256 MiB buffer and a gather of 3 KiB chunks from random positions (and
#    the same gather in 2 threads), interleaved with
#    `sweep --workers 0,1,2,4` (1 epoch; and 10 epochs, for the steady state)
#    over a folder of COUNT 64x64 RGB JPEGs (tests/e2e/make_folder.py)
#    prepared with `prep --size 32 --rgb` (records of 3x32x32 bytes).
# C. Where the time per sample goes: bench/lmdb_gather.c (cc -O2 -llmdb)
#    reads both stoke databases with liblmdb directly, the loader's way
#    (mdb_get, header, memcpy per sample) and other ways, 1 and 2 threads.
# D. Time to first batch in a fresh process: bench/loader_cold.c, linked
#    against build/'s static libraries, opens the store and a loader and
#    reads one epoch with nothing read before (sweep warms up first), COLD
#    (default 5) runs per database and worker count.
#
# usage: bench/loader_bench.sh [WORK_DIR]    (default /tmp/stoke-loader-bench)
# environment: REPS (part A runs per configuration, default 7), BW_REPS
#   (part B rounds, default 7), COLD (part D runs, default 5), COUNT (JPEG
#   files, default 20000), PREP and
#   SWEEP (binaries, default build/bin/*, built when missing), IDX_DIR
#   (default /usr/share/datasets/fashion-mnist).
# The datasets are made once under WORK_DIR and kept; raw results go to
# WORK_DIR/results.jsonl, the report (markdown) to stdout and
# WORK_DIR/report.md.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BENCH=$ROOT/bench
WORK=${1:-/tmp/stoke-loader-bench}
REPS=${REPS:-7}
BW_REPS=${BW_REPS:-7}
COUNT=${COUNT:-20000}
IDX_DIR=${IDX_DIR:-/usr/share/datasets/fashion-mnist}
PREP=${PREP:-$ROOT/build/bin/prep}
SWEEP=${SWEEP:-$ROOT/build/bin/sweep}
PY=/usr/bin/python3 # Debian's interpreter, with python3-{torch,numpy,lmdb,pil}
WORKERS=(0 1 2 4)
BATCH=256

die() { echo "loader_bench: $*" >&2; exit 1; }
say() { echo "loader_bench: $*" >&2; }

if [ ! -x "$PREP" ] || [ ! -x "$SWEEP" ]; then
    "$ROOT/scripts/build.sh" >&2
fi
if [ ! -x "$PREP" ] || [ ! -x "$SWEEP" ]; then
    die "no prep/sweep binaries in $ROOT/build/bin"
fi
"$PY" -c 'import torch, numpy, lmdb, PIL' 2>/dev/null ||
    die "$PY lacks torch/numpy/lmdb/PIL: apt-get install -y python3-torch python3-numpy python3-lmdb python3-pil"

mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
FM=$WORK/fm-stoke
JPEG=$WORK/jpeg64-$COUNT
FOLDER=$WORK/folder32-$COUNT
RESULTS=$WORK/results.jsonl
MEMCPY=$WORK/memcpy_bw
GATHER=$WORK/lmdb_gather
COLDBIN=$WORK/loader_cold
COLD=${COLD:-5}
TMPJSON=$WORK/sweep.json

start=$EPOCHREALTIME
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

# ------------------------------------------------------------ preparation
cc -O2 -Wall -o "$MEMCPY" "$BENCH/memcpy_bw.c" -lpthread
cc -O2 -Wall -o "$GATHER" "$BENCH/lmdb_gather.c" -llmdb -lpthread
B=$ROOT/build
cc -O2 -Wall -I"$ROOT" -o "$COLDBIN" "$BENCH/loader_cold.c" "$B/loader/libstk_loader.a" \
    "$B/preprocess/libstk_preprocess.a" "$B/store/libstk_store.a" "$B/common/libstk_common.a" \
    -lcjson -llmdb -lturbojpeg -lspng -lz -lm -lpthread ||
    { say "cannot link bench/loader_cold.c against $B, part D skipped"; COLD=0; }
[ -d "$FM" ] || "$PREP" --quiet "$IDX_DIR" "$FM" >&2
"$PY" "$BENCH/loader_peers.py" make "$IDX_DIR" "$WORK"
check=$("$PY" "$BENCH/loader_peers.py" check "$FM" "$WORK") || die "$check"
if [ ! -d "$JPEG" ]; then
    say "making $JPEG"
    rm -rf "$JPEG.tmp"
    STK_SRC=$ROOT PYTHONPATH=$ROOT/tests/e2e "$PY" "$ROOT/tests/e2e/make_folder.py" "$JPEG.tmp" "$COUNT" 64
    mv "$JPEG.tmp" "$JPEG"
fi
[ -d "$FOLDER" ] || "$PREP" --quiet --size 32 --rgb "$JPEG" "$FOLDER" >&2

warm() { # every input in the page cache (each tool also reads its data once more per run)
    cat "$FM/data.mdb" "$WORK/peer-lmdb/data.mdb" "$FOLDER/data.mdb" >/dev/null
    find "$WORK/peer-pkl/train" -type f -print0 | xargs -0 cat >/dev/null
}

# -------------------------------------------------------------- A: epochs
: >"$RESULTS"
sweep_json() { # part tool rep: sweep's JSON (TMPJSON) -> lines of RESULTS
    "$PY" - "$TMPJSON" "$1" "$2" "$3" >>"$RESULTS" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    r.update(part=sys.argv[2], tool=sys.argv[3], rep=int(sys.argv[4]), epochs=d["epochs"],
             shape=d["shape"], batch=d["batch"])
    print(json.dumps(r))
EOF
}

run_a() { # rep workers tool
    local rep=$1 w=$2 tool=$3 line
    if [ "$tool" = stoke ]; then
        "$SWEEP" --db "$FM" --workers "$w" --batch $BATCH --epochs 1 --json "$TMPJSON" >/dev/null ||
            die "sweep failed"
        sweep_json A stoke "$rep"
        line=$(tail -n1 "$RESULTS")
    else
        line=$("$PY" "$BENCH/loader_peers.py" time "$tool" "$w" "$WORK" --batch $BATCH --seed "$rep") ||
            die "loader_peers.py time $tool $w failed"
        line=$("$PY" -c 'import json, sys; d = json.loads(sys.argv[1]); d.update(part="A", rep=int(sys.argv[2])); print(json.dumps(d))' "$line" "$rep")
        echo "$line" >>"$RESULTS"
    fi
    "$PY" -c 'import json, sys; d = json.loads(sys.argv[1]); print("loader_bench: A rep %d workers %d %-6s %9.0f samples/s  first batch %7.2f ms" % (d["rep"], d["workers"], d["tool"], d["samples_per_s"], 1e3 * d["first_batch_s"]), file=sys.stderr)' "$line"
}

TOOLS=(stoke pickle lmdb)
for ((rep = 1; rep <= REPS; rep++)); do
    warm
    for w in "${WORKERS[@]}"; do
        for ((i = 0; i < 3; i++)); do
            run_a "$rep" "$w" "${TOOLS[(i + rep - 1) % 3]}"
        done
    done
done

# ----------------------------------------------------------- B: bandwidth
for ((rep = 1; rep <= BW_REPS; rep++)); do
    "$MEMCPY" --mib 256 --reps 7 --chunk 3072 --threads 2 |
        "$PY" -c 'import json, sys; d = json.loads(sys.stdin.read()); d.update(part="B", tool="memcpy", rep=int(sys.argv[1])); print(json.dumps(d))' "$rep" >>"$RESULTS"
    say "B rep $rep memcpy $(tail -n1 "$RESULTS")"
    for epochs in 1 10; do
        "$SWEEP" --db "$FOLDER" --workers 0,1,2,4 --batch $BATCH --epochs $epochs --json "$TMPJSON" >/dev/null ||
            die "sweep failed"
        sweep_json B "stoke-e$epochs" "$rep"
    done
    say "B rep $rep sweep done"
done
rm -f "$TMPJSON"

# ---------------------------------------------------------- C: diagnosis
for db in "$FOLDER" "$FM"; do
    for t in 1 2; do
        "$GATHER" "$db" --threads "$t" --epochs 7 |
            "$PY" -c 'import json, sys; d = json.loads(sys.stdin.read()); d.update(part="C", tool="lmdb_gather"); print(json.dumps(d))' >>"$RESULTS"
        say "C $(tail -n1 "$RESULTS")"
    done
done

# ------------------------------------------------- D: fresh-process start
for ((rep = 1; rep <= COLD; rep++)); do
    for db in "$FM" "$FOLDER"; do
        for w in "${WORKERS[@]}"; do
            "$COLDBIN" "$db" "$w" $BATCH |
                "$PY" -c 'import json, sys; d = json.loads(sys.stdin.read()); d.update(part="D", tool="cold", db=sys.argv[1], rep=int(sys.argv[2])); print(json.dumps(d))' "$(basename "$db")" "$rep" >>"$RESULTS"
        done
    done
done

elapsed=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.0f", b - a }')
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

# ------------------------------------------------------------------ report
ver() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || echo '?'; }
{
cat <<EOF
Machine: $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), \
$(lscpu | awk -F: '/^Hypervisor vendor/ { gsub(/^ +/, "", $2); print $2 " guest" }')), \
$(awk '/MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo) memory, \
$(. /etc/os-release && echo "$PRETTY_NAME"), kernel $(uname -r), $(df -T "$WORK" | awk 'NR == 2 { print $2 }') at $WORK
Versions: $("$PY" -c 'import sys, torch, numpy, lmdb; print("python %s, torch %s (python3-torch %s, CUDA %s), numpy %s, python3-lmdb %s (liblmdb %s)" % (sys.version.split()[0], torch.__version__, sys.argv[1], torch.version.cuda, numpy.__version__, lmdb.__version__, ".".join(map(str, lmdb.version()))))' "$(ver python3-torch)"), \
cc $(cc -dumpfullversion), stoke $(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo '?') (build type $(awk -F= '/^CMAKE_BUILD_TYPE:/ { print $2 }' "$ROOT/build/CMakeCache.txt" 2>/dev/null))
Load average (1, 5, 15 min): $load_before before, $load_after after. $elapsed s in all.
Data: $check
EOF
"$PY" - "$RESULTS" "$REPS" "$BW_REPS" <<'EOF'
import collections, json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
reps, bw_reps = sys.argv[2], sys.argv[3]
med = statistics.median
A = collections.defaultdict(list)
for r in rows:
    if r["part"] == "A":
        A[r["tool"], r["workers"]].append(r)
W = sorted({w for _, w in A})
tools = ["stoke", "pickle", "lmdb"]

def col(tool, w, k):
    return [r[k] for r in A[tool, w]]

sps = {k: med([r["samples_per_s"] for r in v]) for k, v in A.items()}
fb = {k: med([r["first_batch_s"] for r in v]) for k, v in A.items()}

print("\n## A. Fashion-MNIST train, 60000 x 1x28x28, batch 256, shuffled, 1 epoch\n")
print("samples/s, median of %s runs (min-max):\n" % reps)
print("| workers | stoke | (a) DataLoader + pickle files | (b) DataLoader + python3-lmdb | stoke / (a) | stoke / (b) |")
print("|---:|---:|---:|---:|---:|---:|")
for w in W:
    cells = ["%.0f (%.0f-%.0f)" % (sps[t, w], min(col(t, w, "samples_per_s")), max(col(t, w, "samples_per_s")))
             for t in tools]
    print("| %d | %s | %.1fx | %.1fx |" % (w, " | ".join(cells), sps["stoke", w] / sps["pickle", w],
                                          sps["stoke", w] / sps["lmdb", w]))
print("\nTime to first batch, ms, median (max):\n")
print("| workers | stoke | (a) pickle | (b) lmdb |")
print("|---:|---:|---:|---:|")
for w in W:
    print("| %d | %s |" % (w, " | ".join("%.2f (%.2f)" % (1e3 * fb[t, w], 1e3 * max(col(t, w, "first_batch_s")))
                                         for t in tools)))
print("\nstoke's loader in those runs: bytes/s (median), data stall and worker busy share:\n")
print("| workers | MB/s | stall | busy per worker |")
print("|---:|---:|---:|---:|")
for w in W:
    rs = A["stoke", w]
    busy = med([sum(r["busy_s"]) / len(r["busy_s"]) / r["elapsed_s"] for r in rs])
    print("| %d | %.0f | %.0f%% | %.0f%% |" % (w, med([r["bytes_per_s"] for r in rs]) / 1e6,
                                           100 * med([r["stall"] for r in rs]), 100 * busy))
peers = [r for r in rows if r["part"] == "A" and r["tool"] != "stoke"]
print("\npin_memory=True in the peers: torch.cuda.is_available() = %s; the iterator's "
      "_pin_memory = %s; batches pinned: %s; warnings: %s" % (
          sorted({r["cuda_available"] for r in peers}), sorted({r["pin_memory_effective"] for r in peers}),
          sorted({r["batch_is_pinned"] for r in peers}),
          sorted({w for r in peers for w in r["warnings"]}) or "none"))

B = [r for r in rows if r["part"] == "B"]
mc = [r for r in B if r["tool"] == "memcpy"]
memcpy = med([r["memcpy_gbs"] for r in mc])
gather = med([r["gather_gbs"] for r in mc])
gather2 = med([r["gather_par_gbs"] for r in mc])
print("\n## B. Bandwidth: memcpy against the loader on 3x32x32 records\n")
print("memcpy_bw (best of 7 per round, median of %s rounds, min-max), GB/s = 1e9 bytes copied/s:\n" % bw_reps)
print("| measurement | GB/s |")
print("|---|---:|")
for k, name in (("memcpy_gbs", "memcpy, 256 MiB buffer, 1 thread"),
                ("gather_gbs", "3 KiB chunks from random positions of 256 MiB, 1 thread"),
                ("gather_par_gbs", "the same gather, 2 threads at once (aggregate)")):
    v = [r[k] for r in mc]
    print("| %s | %.2f (%.2f-%.2f) |" % (name, med(v), min(v), max(v)))
SB = collections.defaultdict(list)
for r in B:
    if r["tool"] != "memcpy":
        SB[r["tool"], r["workers"]].append(r)
n = sorted({r["samples"] // r["epochs"] for r in B if r["tool"] != "memcpy"})
print("\nstoke loader over the JPEG folder prepared with --size 32 --rgb (%s samples of 3x32x32), "
      "batch 256, median of %s sweeps (min-max):\n" % (n, bw_reps))
print("| workers | epochs | samples/s | GB/s | / memcpy | / 1-thread gather | first batch ms |")
print("|---:|---:|---:|---:|---:|---:|---:|")
for e in (1, 10):
    for w in sorted({w for t, w in SB if t == "stoke-e%d" % e}):
        rs = SB["stoke-e%d" % e, w]
        b = [r["bytes_per_s"] / 1e9 for r in rs]
        print("| %d | %d | %.0f | %.2f (%.2f-%.2f) | %.2f | %.2f | %.2f |" % (
            w, e, med([r["samples_per_s"] for r in rs]), med(b), min(b), max(b),
            med(b) / memcpy, med(b) / gather, 1e3 * med([r["first_batch_s"] for r in rs])))

C = [r for r in rows if r["part"] == "C"]
ways = ["serial", "lookup", "twopass", "sorted", "table"]
print("\n## C. Where the time goes: liblmdb read directly (bench/lmdb_gather.c)\n")
print("Shuffled epochs, batch 256, one read transaction per batch, median of 7 epochs; "
      "samples/s (GB/s of pixels). serial = what the loader does per sample (mdb_get, read "
      "the header, memcpy); lookup = mdb_get alone; twopass = all mdb_get of a batch first "
      "with a prefetch of each value, then the copies; sorted = twopass in key order; "
      "table = no lookups: value addresses taken once by a cursor walk (build time "
      "shown), then prefetch + copy. The last column is stoke's loader at the same worker count "
      "(1 epoch, median from A / B above).\n")
print("| database | threads | serial | lookup only | twopass | sorted | table (build ms) | stoke loader |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for r in C:
    fm = r["record_bytes"] == 784
    w = r["threads"]
    if fm:
        ref = sps["stoke", w]
    else:
        ref = med([x["samples_per_s"] for x in SB["stoke-e1", w]])
    cells = ["%.0f (%.2f)" % (r[k + "_sps"], r[k + "_gbs"]) for k in ways]
    cells[-1] += " (%.1f ms)" % r["table_build_ms"]
    print("| %s | %d | %s | %.0f (%.2f) |" % (
        "Fashion-MNIST 1x28x28" if fm else "folder 3x32x32", w, " | ".join(cells), ref,
        ref * r["record_bytes"] / 1e9))

D = collections.defaultdict(list)
for r in rows:
    if r["part"] == "D":
        D[r["db"], r["workers"]].append(r)
if D:
    print("\n## D. Time to first batch in a fresh process (bench/loader_cold.c)\n")
    print("Nothing read before the clock starts (page cache warm, page tables not); "
          "median (max) of %d runs; first batch = stk_loader_open to the first batch in hand; "
          "samples/s over that first epoch.\n" % len(next(iter(D.values()))))
    print("| database | workers | store open ms | first batch ms | first epoch samples/s |")
    print("|---|---:|---:|---:|---:|")
    for (db, w), rs in sorted(D.items()):
        print("| %s | %d | %.2f (%.2f) | %.2f (%.2f) | %.0f |" % (
            db, w, med([r["store_open_ms"] for r in rs]), max(r["store_open_ms"] for r in rs),
            med([r["first_batch_ms"] for r in rs]), max(r["first_batch_ms"] for r in rs),
            med([r["samples_per_s"] for r in rs])))

print("\n## Targets\n")
for w in W:
    r = sps["stoke", w] / sps["pickle", w]
    print("- stoke >= 20x (a) pickle files at %d workers: %.1fx, %s" % (w, r, "met" if r >= 20 else "NOT met"))
for w in W:
    r = sps["stoke", w] / sps["lmdb", w]
    print("- stoke >= 10x (b) python3-lmdb at %d workers: %.1fx, %s" % (w, r, "met" if r >= 10 else "NOT met"))
worst = max(fb["stoke", w] for w in W)
worst_any = max(r["first_batch_s"] for w in W for r in A["stoke", w])
print("- stoke time to first batch < 50 ms: median at most %.2f ms over the worker counts "
      "(slowest single run %.2f ms), %s" % (1e3 * worst, 1e3 * worst_any, "met" if worst < 0.05 else "NOT met"))
if D:
    cw = max(med([r["first_batch_ms"] for r in rs]) for rs in D.values())
    ca = max(r["first_batch_ms"] + r["store_open_ms"] for rs in D.values() for r in rs)
    print("  (fresh process, part D: median at most %.2f ms; slowest run, store open included, %.2f ms: %s)"
          % (cw, ca, "met" if cw < 50 else "NOT met"))
b2 = med([r["bytes_per_s"] / 1e9 for r in SB["stoke-e1", 2]])
print("- stoke bytes/s with 2 workers >= half the single-thread memcpy bandwidth (3x32x32 records, "
      "1 epoch): %.2f GB/s against %.2f / 2 = %.2f GB/s (%.0f%%), %s" % (
          b2, memcpy, memcpy / 2, 100 * b2 / memcpy, "met" if b2 >= memcpy / 2 else "NOT met"))
b2e = med([r["bytes_per_s"] / 1e9 for r in SB["stoke-e10", 2]])
print("  (10 epochs, steady state: %.2f GB/s, %.0f%% of memcpy)" % (b2e, 100 * b2e / memcpy))
EOF
} | tee "$WORK/report.md"
