#!/usr/bin/env bash
# sweep times each worker count over a real database (and the raw folder
# side by side), prints a table and a recommendation, writes JSON and SVG,
# and refuses bad flags and incomplete databases with clear messages.
source "$STK_SRC/tests/e2e/lib.sh"
S="$STK_BIN/sweep"
$PY "$STK_SRC/tests/e2e/make_folder.py" raw 600 48
"$STK_BIN/prep" --quiet --size 32 raw db
"$S" --db db --workers 0,1,2 --batch 64 --epochs 2 --raw raw --consume-ms 0.2 \
  --json out.json --plot out.svg > table.txt
cat table.txt
grep -Eq "^lmdb +2 " table.txt || fail "no lmdb row for 2 workers"
grep -Eq "^raw +1 " table.txt || fail "no raw row"
grep -Eq "^recommendation: --workers [012] " table.txt || fail "no recommendation"
$PY - <<'PY' || fail "sweep JSON/SVG"
import json, xml.dom.minidom
j = json.load(open("out.json"))
rows = j["results"]
assert [(r["source"], r["workers"]) for r in rows] == [("lmdb", 0), ("lmdb", 1), ("lmdb", 2), ("raw", 0), ("raw", 1), ("raw", 2)], rows
for r in rows:
    assert r["samples"] == 2 * 600, r           # two whole epochs each
    assert r["samples_per_s"] > 0 and 0 < r["first_batch_s"] < r["elapsed_s"]
    assert 0 <= r["stall"] <= 1 and len(r["busy_s"]) == max(1, r["workers"])
    assert abs(r["bytes_per_s"] / r["samples_per_s"] - 3 * 32 * 32) < 1e-6 * r["bytes_per_s"]
best = max(r["samples_per_s"] for r in rows if r["source"] == "lmdb")
pick = min(r["workers"] for r in rows if r["source"] == "lmdb" and r["samples_per_s"] >= 0.95 * best)
assert j["recommended_workers"] == pick, (j["recommended_workers"], pick)
assert j["shape"] == [3, 32, 32] and j["batch"] == 64
svg = xml.dom.minidom.parse("out.svg")
assert len(svg.getElementsByTagName("polyline")) == 2
print("ok: JSON holds every run; recommendation is the fewest workers within 5% of the best; SVG parses")
PY
# transforms: every batch is 3 x N x N, for the database and the files alike
for t in "--augment rrc --crop-size 24" "--eval --crop-size 24" "--augment crop"; do
  "$S" --db db --workers 0,2 --batch 64 --epochs 1 --raw raw $t --json t.json > t.txt || fail "sweep $t"
  n=$([ "$t" = "--augment crop" ] && echo 32 || echo 24)
  $PY -c "import json; j = json.load(open('t.json')); assert all(abs(r['bytes_per_s'] / r['samples_per_s'] - 3 * $n * $n) < 1e-6 * r['bytes_per_s'] and r['samples'] == 600 for r in j['results']), j" || fail "sweep $t: sample size"
done
ok "--augment rrc, --eval and --augment crop over the database and --raw"
# a database prep --skip-bad wrote: --raw leaves out the files prep left
# out (it failed at the first), so both rows time the same 599 samples;
# prep was given another spelling of the folder than sweep
cp -r raw rawbad && bad=$(find rawbad -name '*.jpg' | sort | sed -n 1p) && : > "$bad"
[ -n "$bad" ] && [ ! -s "$bad" ] || fail "no emptied file in rawbad"
"$STK_BIN/prep" --quiet --skip-bad --size 32 ./rawbad/ dbbad > /dev/null
"$S" --db dbbad --workers 0,1 --batch 64 --epochs 1 --raw rawbad --json bad.json > /dev/null 2> bad.txt \
  || fail "sweep --raw over a --skip-bad database: $(cat bad.txt)"
grep -q "sweep: --raw leaves out the 1 file(s) that prep --skip-bad left out of dbbad's split train" bad.txt \
  || fail "no line for the file left out: $(cat bad.txt)"
$PY -c "import json; j = json.load(open('bad.json')); assert [r['samples'] for r in j['results']] == [599] * 4, j" \
  || fail "sweep --raw over a --skip-bad database: the rows' samples"
ok "--raw leaves out the files a --skip-bad database left out"
# an aspect-keeping database: rrc by default (as train); none and crop time
# the centre crop to 0.875 x 40 = 35 that train's loader does for them (they
# had failed after the table's header)
"$STK_BIN/prep" --quiet --short-side 40 raw dbv
"$S" --db dbv --workers 0 --batch 64 --epochs 1 > v.txt || fail "sweep on dbv: $(cat v.txt)"
grep -q "transform rrc (to 35)" v.txt || fail "the default on dbv: $(cat v.txt)"
for a in none crop; do
  "$S" --db dbv --workers 0,1 --batch 64 --epochs 1 --raw raw --augment $a --json v.json > v.txt 2>&1 \
    || fail "--augment $a on an aspect-keeping database: $(cat v.txt)"
  $PY -c "import json; j = json.load(open('v.json')); assert all(abs(r['bytes_per_s'] / r['samples_per_s'] - 3 * 35 * 35) < 1e-6 * r['bytes_per_s'] and r['samples'] == 600 for r in j['results']), j" \
    || fail "--augment $a on an aspect-keeping database: sample size"
done
ok "an aspect-keeping database: rrc by default, none and crop time the centre crop"
expect_fail 2 "--augment: expected none, crop or rrc, got 'x'" "$S" --db db --augment x
expect_fail 2 "--eval and --augment rrc exclude each other" "$S" --db db --eval --augment rrc
expect_fail 2 "--workers: expected a whole number 0..64, got 'x'" "$S" --db db --workers 1,x
for w in 0,,2 2, ,2 ""; do
  expect_fail 2 "^sweep: --workers: expected whole numbers 0..64 separated by single commas, such as 0,1,2,4, got '$w'\$" "$S" --db db --workers "$w"
done
expect_fail 2 "--db DB_DIR is required" "$S" --workers 1
expect_fail 2 "unknown option '--turbo'" "$S" --db db --turbo
expect_fail 2 "--split: no split \"test\"" "$S" --db db --split test --json no.json
[ ! -e no.json ] || fail "a refused sweep wrote its --json"
expect_fail 1 "nodb: not a stoke database" "$S" --db nodb
mkdir half && cp db/data.mdb half/ && $PY - <<'PY'
import lmdb, json
env = lmdb.open("half", max_dbs=4)
meta = env.open_db(b"meta")
with env.begin(write=True, db=meta) as txn:
    j = json.loads(txn.get(b"dataset")); j["complete"] = False
    txn.put(b"dataset", json.dumps(j).encode())
PY
expect_fail 1 "half: database is incomplete" "$S" --db half

# Outputs must be regular files: a FIFO as --json or --plot is refused by
# name, never waited on (timeout: if opening it blocks again, this fails
# instead of hanging the suite), and a regular file is replaced.
mkfifo out.fifo
expect_fail 1 "sweep: error: out.fifo: not a regular file \(a FIFO\)" timeout -k 5 300 "$S" --db db --workers 1 --epochs 1 --json out.fifo
expect_fail 1 "sweep: error: out.fifo: not a regular file \(a FIFO\)" timeout -k 5 300 "$S" --db db --workers 1 --epochs 1 --plot out.fifo
[ -p out.fifo ] || fail "a refused sweep replaced its FIFO"
head -c 100000 /dev/urandom > out.json
"$S" --db db --workers 1 --epochs 1 --json out.json >/dev/null
$PY -c "import json; j = json.load(open('out.json')); assert [r['workers'] for r in j['results']] == [1], j" || fail "--json over a regular file"
ok "--json and --plot refuse a FIFO and replace a regular file"
