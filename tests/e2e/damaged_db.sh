#!/usr/bin/env bash
# A damaged database is refused by every tool (dbinfo, dbinfo --verify,
# sweep, train, prep onto it) with exit 1 and one line saying what is wrong,
# never a crash: data.mdb cut short, a branch page's type, a leaf's bounds,
# a node offset, a child and an overflow page number, a meta page's page
# size (liblmdb divides by it), a dropped split; a tampered record is found
# by dbinfo --verify. Names that are not UTF-8 keep their bytes through the
# documented Python reader, and dbinfo prints control characters escaped.
source "$STK_SRC/tests/e2e/lib.sh"
P="$STK_BIN/prep"
D="$STK_BIN/dbinfo"
$PY "$STK_SRC/tests/e2e/fm_subset.py" "$FASHION" raw 2000
"$P" --quiet raw good
"$D" good --verify | grep -q "^verify    12000 records: ok$" || fail "good does not verify"
$PY "$STK_SRC/tests/e2e/make_folder.py" col 60 48
"$P" --quiet --size 40 col big # 4808-byte records: on overflow pages
"$D" big --verify | grep -q "^verify    60 records: ok$" || fail "big does not verify"

# damage SRC DST MODE: a copy of SRC with one kind of damage, found by
# reading data.mdb's pages with this script's own parser (LMDB 0.9 layout).
damage() {
  cp -r "$1" "$2"
  $PY - "$2/data.mdb" "$3" <<'PY'
import struct, sys
path, mode = sys.argv[1], sys.argv[2]
d = bytearray(open(path, "rb").read())
ps = 4096
def hdr(n): return struct.unpack_from("<QHHHH", d, n * ps)  # pgno pad flags lower upper
pages = [n for n in range(2, len(d) // ps) if hdr(n)[0] == n]
branch = [n for n in pages if hdr(n)[2] == 1]
leaves = [n for n in pages if hdr(n)[2] == 2 and hdr(n)[3] == 16 + 2 * 5]  # 5 records
def node(n, i): return n * ps + struct.unpack_from("<H", d, n * ps + 16 + 2 * i)[0]
if mode == "branch-type":
    d[branch[0] * ps + 10] = 0x04                       # an overflow page's type
elif mode == "leaf-bounds":
    struct.pack_into("<H", d, leaves[3] * ps + 14, 5000) # upper past the page
elif mode == "node-offset":
    struct.pack_into("<H", d, leaves[3] * ps + 16, 4094)
elif mode == "child":
    struct.pack_into("<H", d, node(branch[0], 1), 0xfff0) # child pgno, low 16 bits
elif mode == "overflow":
    big = [n for n in pages if hdr(n)[2] == 2 and struct.unpack_from("<H", d, node(n, 0) + 4)[0] == 1]
    o = node(big[0], 0)
    struct.pack_into("<Q", d, o + 8 + struct.unpack_from("<H", d, o + 6)[0], 0x7fffffff)
elif mode == "meta-psize":
    for m in (0, 1):
        struct.pack_into("<I", d, m * ps + 16 + 24, 0)
else:
    sys.exit("unknown mode " + mode)
open(path, "wb").write(d)
PY
}

# every_tool DB PATTERN: each tool refuses DB with exit 1 and PATTERN
every_tool() {
  local db=$1 pat=$2
  expect_fail 1 "^dbinfo: error: $pat" "$D" "$db"
  expect_fail 1 "^dbinfo: error: $pat" "$D" "$db" --verify
  expect_fail 1 "$pat" "$STK_BIN/sweep" --db "$db" --workers 1 --epochs 1
  expect_fail 1 "$pat" "$STK_BIN/train" --db "$db" --model mlp --epochs 1 \
    --quiet --out "run-$db"
  expect_fail 1 "$db: holds an LMDB database that stoke cannot open \($pat\); pass --force to replace it" \
    "$P" --quiet raw "$db"
}

size=$(stat -c %s good/data.mdb)
cp -r good trunc && truncate -s $((size / 2)) trunc/data.mdb
every_tool trunc "trunc: data.mdb is truncated \($((size / 2)) of $size bytes\)"
damage good branch "branch-type"
every_tool branch 'branch: data.mdb is damaged \(database "(train|test)", page [0-9]+: page flags 0x4 where a branch page is due\)'
damage good bounds "leaf-bounds"
every_tool bounds 'bounds: data.mdb is damaged \(database "(train|test)", page [0-9]+: free-space bounds 26\.\.5000 are not inside the page\)'
damage good offset "node-offset"
every_tool offset "offset: data.mdb is damaged \(database \"(train|test)\", page [0-9]+: node 0 at offset 4094 is outside the page's node area\)"
damage good child "child"
every_tool child 'child: data.mdb is damaged \(database "(train|test)", page [0-9]+: points to page [0-9]+, outside pages 2\.\.[0-9]+\)'
damage good psize "meta-psize"
every_tool psize "psize: data.mdb is damaged \(meta page 0: page size 0 is not a power of two in 512\.\.65536\)"
damage big over "overflow"
expect_fail 1 '^dbinfo: error: over: data.mdb is damaged \(database "train", page [0-9]+: points to page 2147483647, outside pages 2\.\.[0-9]+\)' "$D" over
expect_fail 1 "over: data.mdb is damaged" "$STK_BIN/sweep" --db over --workers 1 --epochs 1

# the way back: --force replaces a damaged database with a good one
"$P" --quiet --force raw trunc
"$D" trunc --verify | grep -q "^verify    12000 records: ok$" || fail "--force did not rebuild trunc"
ok "prep --force replaced the truncated database"

# a split whose database is gone
cp -r good dropped && $PY - <<'PY'
import lmdb
env = lmdb.open("dropped", max_dbs=8)
with env.begin(write=True) as txn:
    txn.drop(env.open_db(b"test", txn=txn), delete=True)
PY
every_tool dropped 'dropped: split "test" is listed in the metadata but its database is missing'

# a record changed behind LMDB's back: only --verify reads every record
cp -r good tampered && $PY - <<'PY'
import lmdb, struct
env = lmdb.open("tampered", max_dbs=8)
with env.begin(write=True, db=env.open_db(b"train")) as txn:
    key = struct.pack(">Q", 1234)
    v = bytearray(txn.get(key)); v[8 + 400] ^= 0x55
    txn.put(key, bytes(v))
PY
"$D" tampered > /dev/null || fail "dbinfo without --verify refuses an intact structure"
expect_fail 1 '^dbinfo: error: tampered: split "train": key 1234: the record'"'"'s crc32 is [0-9a-f]{8}, its checksum list says [0-9a-f]{8} \(changed after prep wrote it\)' "$D" tampered --verify

# --- names that are not UTF-8 --------------------------------------------------
$PY "$STK_SRC/tests/e2e/make_folder.py" names 40 32
$PY - <<'PY'
import os
os.rename(b"names/class1", b"names/caf\xe9")                # Latin-1, not UTF-8
os.rename(b"names/class2", b"names/red\x1b[31m\xff")        # an escape sequence
open(b"names/caf\xe9/bad\xfe\x1b[2J.png", "wb").write(b"not an image")
PY
"$P" --quiet --skip-bad names ndb
$PY - <<'PY' || fail "non-UTF-8 names through the documented reader"
import json, os, lmdb, stoke_test as t
env, meta = t.formats_reader()["open_stoke"]("ndb")
classes = [os.fsencode(c) for c in meta["classes"]]
assert b"caf\xe9" in classes and b"red\x1b[31m\xff" in classes, classes
sk = meta["skipped_files"]["train"]
assert [os.fsencode(s["file"]).endswith(b"/caf\xe9/bad\xfe\x1b[2J.png") for s in sk] == [True], sk
with env.begin() as txn:
    raw = txn.get(b"dataset", db=env.open_db(b"meta", txn=txn))
raw.decode("utf-8")  # strict: the file is UTF-8
assert json.dumps(os.fsdecode(b"caf\xe9")).encode() in raw, raw[:400]  # Python's own escape
print("ok: class and file names keep their bytes:", classes[1:3], os.fsencode(sk[0]["file"])[-22:])
PY
"$D" ndb --verify > info.txt || fail "ndb does not verify"
! grep -q $'\x1b' info.txt || fail "dbinfo printed an escape character"
grep -qF 'red\x1b[31m\xff' info.txt || fail "dbinfo does not show the escaped class name: $(cat info.txt)"
grep -qF 'caf\xe9/bad\xfe\x1b[2J.png' info.txt || fail "dbinfo does not show the escaped file name"
ok "dbinfo escapes control characters and bytes that are not UTF-8"
