#!/usr/bin/env bash
# Bad input gets a one-line error naming the file and the problem, a non-zero
# exit, and nothing at DB_DIR that looks valid; --skip-bad records bad files
# instead; an existing database is never replaced without --force.
source "$STK_SRC/tests/e2e/lib.sh"
P="$STK_BIN/prep"
absent() { [ ! -e "$1" ] && ! ls -d .*partial >/dev/null 2>&1 || fail "$1 or a partial dir was left behind"; }

# --- image folders ---------------------------------------------------------
$PY "$STK_SRC/tests/e2e/make_folder.py" good 200 32
cp -r good badjpg && head -c 400 good/class1/$(ls good/class1 | head -1) > badjpg/class1/cut.jpg
expect_fail 1 "badjpg/class1/cut.jpg: bad JPEG" "$P" --quiet badjpg db; absent db
cp -r good garbage && head -c 1000 /dev/urandom > garbage/class2/noise.png
expect_fail 1 "garbage/class2/noise.png: not a PNG or JPEG" "$P" --quiet garbage db; absent db
cp -r good badpng && $PY - <<'PY'
from PIL import Image; import io
Image.new("RGB", (40, 40), (10, 200, 30)).save("full.png")
data = open("full.png", "rb").read(); open("badpng/class3/half.png", "wb").write(data[: len(data) // 2])
PY
expect_fail 1 "badpng/class3/half.png: bad PNG" "$P" --quiet badpng db; absent db

# --skip-bad: the bad files are recorded, keys stay dense
$PY "$STK_SRC/tests/e2e/make_folder.py" skip 200 32 4
out=$("$P" --skip-bad --workers 2 skip db)
grep -q "skipped 4 bad file" <<<"$out" || fail "summary lacks the skip count: $out"
$PY - <<'PY' || fail "--skip-bad metadata"
import stoke_test as t
r = t.formats_reader(); env, meta = r["open_stoke"]("db")
sp = meta["splits"]["train"]; sk = meta["skipped_files"]["train"]
assert sp["count"] == 200 and sp["skipped"] == 4, sp
assert sorted(s["file"].split("/")[-1] for s in sk) == ["bad0.jpg", "bad1.png", "bad2.jpg", "bad3.png"], sk
assert all(s["error"] for s in sk)
r["read_sample"](env, meta, "train", 199)
print("ok: --skip-bad recorded", [s["file"] for s in sk])
PY
"$STK_BIN/dbinfo" db | grep -q "bad1.png: bad PNG" || fail "dbinfo does not list skipped files"
rm -rf db
# dbinfo --split lists the skipped files of that split alone
"$P" --quiet --skip-bad --holdout 0.5 skip dbh > /dev/null
for s in train test; do
  other=$([ $s = train ] && echo test || echo train)
  out=$("$STK_BIN/dbinfo" dbh --split $s)
  grep -q "^skipped in $s:" <<<"$out" && ! grep -q "skipped in $other" <<<"$out" \
    || fail "dbinfo --split $s: $out"
done
rm -rf dbh

# meta_py DB CODE: runs CODE with `meta`, DB's metadata read straight from
# LMDB and decoded as Python decodes file names (bytes that are not UTF-8
# become \udcXX), so that it passes whether or not the JSON escapes them.
meta_py() {
  $PY - "$1" <<PY
import json, sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=False, max_dbs=16)
with env.begin() as txn:
    raw = txn.get(b"dataset", db=env.open_db(b"meta", txn=txn))
meta = json.loads(raw.decode("utf-8", "surrogateescape"))
$2
PY
}

# A FIFO named like an image is refused by name, never waited on (timeout:
# if opening it blocks again, this fails instead of hanging the suite);
# --skip-bad records it, and a dangling link. A file name holding ": " keeps
# its path and reason apart in the list.
cp -r good fifo && mkfifo fifo/class2/x.png && head -c 300 /dev/urandom > "fifo/class3/a: b.png"
ln -s /nonexistent/gone.png fifo/class4/gone.png
expect_fail 1 "fifo/class2/x.png: not a regular file \(a FIFO\)" timeout -k 5 300 "$P" --quiet fifo db; absent db
out=$(timeout -k 5 300 "$P" --skip-bad fifo db 2>&1) || fail "--skip-bad with a FIFO: $out"
no_sanitizer_report "prep --skip-bad fifo" "$out"
meta_py db '
sk = meta["skipped_files"]["train"]
want = [{"file": "fifo/class2/x.png", "error": "not a regular file (a FIFO)"},
        {"file": "fifo/class3/a: b.png", "error": "not a PNG or JPEG file (bad magic bytes)"},
        {"file": "fifo/class4/gone.png", "error": "No such file or directory"}]
assert sorted(sk, key=lambda s: s["file"]) == want, sk
assert meta["splits"]["train"]["count"] == 200, meta["splits"]
print("ok: --skip-bad listed the FIFO and the name with \": \"")' || fail "--skip-bad FIFO metadata"
rm -rf db

# An empty first class folder is a class with no samples (it once passed
# NULL to qsort, which UBSan reports).
cp -r good emptyfirst && mkdir emptyfirst/class00
out=$("$P" --quiet emptyfirst db 2>&1) || fail "empty first class folder: $out"
no_sanitizer_report "prep emptyfirst" "$out"
meta_py db '
assert meta["classes"][:2] == ["class0", "class00"], meta["classes"]
assert meta["splits"]["train"]["label_counts"][1] == 0, meta["splits"]
print("ok: an empty first class folder is a class with no samples")' || fail "empty class folder"
rm -rf db

# Names that are not UTF-8 are kept byte for byte; classes and samples are
# in byte order.
$PY - <<'PY'
import os
from PIL import Image
for cls, files in [(b"caf\xe9", [(b"b.png", 30), (b"\x80.png", 31)]),
                   (b"caf\xc3\xa9", [(b"\xff.png", 20)]), (b"cafe", [(b"a.png", 10)])]:
    os.makedirs(b"bytes/" + cls)
    for f, v in files:
        Image.new("RGB", (8, 8), (v, v, v)).save(b"bytes/" + cls + b"/" + f, "PNG")
open(b"bytes/caf\xe9/\xfe: bad.png", "wb").write(b"garbage")
PY
out=$("$P" --quiet --skip-bad --size 8 bytes db 2>&1) || fail "non-UTF-8 names: $out"
no_sanitizer_report "prep bytes" "$out"
meta_py db '
import os, struct
cls = [c.encode("utf-8", "surrogateescape") for c in meta["classes"]]
assert cls == [b"cafe", b"caf\xc3\xa9", b"caf\xe9"], cls
sk = meta["skipped_files"]["train"]
assert [s["file"].encode("utf-8", "surrogateescape") for s in sk] == [b"bytes/caf\xe9/\xfe: bad.png"], sk
assert sk[0]["error"] == "not a PNG or JPEG file (bad magic bytes)", sk
with env.begin(db=env.open_db(b"train")) as txn:
    got = [(struct.unpack_from("<i", v)[0], v[8]) for _, v in txn.cursor()]
# cafe/a.png, café/\xff.png, caf\xe9/b.png, caf\xe9/\x80.png (b < \x80)
assert got == [(0, 10), (1, 20), (2, 30), (2, 31)], got
print("ok: non-UTF-8 names in byte order, kept byte for byte")' || fail "non-UTF-8 names"
rm -rf db

# --- IDX ---------------------------------------------------------------------
mkidx() { mkdir -p "$1" && cp "$FASHION"/*.gz "$1"/; }
mkidx magic && $PY - <<'PY'
import gzip
p = "magic/train-images-idx3-ubyte.gz"; d = bytearray(gzip.decompress(open(p, "rb").read()))
d[3] = 0x01; open(p, "wb").write(gzip.compress(bytes(d), 1))
PY
expect_fail 1 "magic/train-images-idx3-ubyte.gz: bad IDX magic 0x00000801, expected 0x00000803" "$P" --quiet magic db; absent db
mkidx count && $PY - <<'PY'
import gzip, struct
p = "count/t10k-labels-idx1-ubyte.gz"; d = gzip.decompress(open(p, "rb").read())
open(p, "wb").write(gzip.compress(struct.pack(">II", 0x801, 9999) + d[8:8 + 9999], 1))
PY
expect_fail 1 "t10k-images-idx3-ubyte.gz holds 10000 images but .*t10k-labels-idx1-ubyte.gz holds 9999 labels" "$P" --quiet count db; absent db
mkidx trunc && gunzip trunc/train-images-idx3-ubyte.gz && truncate -s 1000000 trunc/train-images-idx3-ubyte
expect_fail 1 "trunc/train-images-idx3-ubyte: header promises 47040000 data bytes but the file holds 999984 \(truncated\)" "$P" --quiet trunc db; absent db
mkidx gztrunc && truncate -s 300000 gztrunc/train-images-idx3-ubyte.gz
expect_fail 1 "gztrunc/train-images-idx3-ubyte.gz: gzip data is truncated" "$P" --quiet gztrunc db; absent db
mkidx fifoidx && rm fifoidx/train-labels-idx1-ubyte.gz && mkfifo fifoidx/train-labels-idx1-ubyte.gz
expect_fail 1 "fifoidx/train-labels-idx1-ubyte.gz: not a regular file \(a FIFO\)" timeout -k 5 300 "$P" --quiet fifoidx db; absent db
mkdir t10k && cp "$FASHION"/t10k-* t10k/
expect_fail 1 "t10k: no train-images-idx3-ubyte\[.gz\] and no train-labels-idx1-ubyte\[.gz\] \(the train split is required; found only t10k-\* files\)" "$P" --quiet t10k db; absent db

# A gzip bomb: one gzip stream of 2 MB that inflates to 2 GiB behind a
# header promising 10 images of 28x28. prep reads the header, then no more
# than it promises plus one byte, so it fails at once under a 1 GB address
# space limit (a sanitized build, which reserves terabytes of shadow memory
# and cannot start under it, has only the time limit to show it).
mkdir bomb && $PY - <<'PY'
import gzip, struct, zlib
# after a full flush deflate starts afresh, so each further MiB of zeros
# compresses to the same bytes: written again, never held inflated
mib, n = bytes(1 << 20), 2048
head = struct.pack(">IIII", 0x803, 10, 28, 28)
c = zlib.compressobj(9, zlib.DEFLATED, 31)
with open("bomb/train-images-idx3-ubyte.gz", "wb") as f:
    f.write(c.compress(head + mib) + c.flush(zlib.Z_FULL_FLUSH))
    f.write((c.compress(mib) + c.flush(zlib.Z_FULL_FLUSH)) * (n - 2))
    f.write(c.compress(mib) + c.flush(zlib.Z_FULL_FLUSH))
    crc = zlib.crc32(head + mib)
    for _ in range(n - 1):
        crc = zlib.crc32(mib, crc)
    end = c.flush()  # the final block, then the trailer: CRC and size
    f.write(end[:-8] + struct.pack("<II", crc, (16 + n * len(mib)) & 0xffffffff))
open("bomb/train-labels-idx1-ubyte.gz", "wb").write(gzip.compress(struct.pack(">II", 0x801, 10) + bytes(10)))
PY
vlimit="ulimit -v 1000000;"
bash -c "$vlimit exec '$P' --help" >/dev/null 2>&1 || vlimit=""
expect_fail 1 "bomb/train-images-idx3-ubyte.gz: header promises 7840 data bytes but the gzip data holds more \(trailing data; reading stopped at 7841 bytes\)" \
  timeout -k 5 300 bash -c "$vlimit exec '$P' --quiet --workers 2 bomb db"; absent db

# Lying headers, under the same 1 GB limit. A header promising 1 GiB over
# 1 MB of gzip that inflates to 1 GiB and 1 MiB (within deflate's 1032:1):
# the content is counted before memory is allocated for it, so the lie is
# refused without the GiB (it once took it).
mkdir lie && $PY - <<'PY'
import gzip, struct, zlib
mib, n = bytes(1 << 20), 1025
head = struct.pack(">IIII", 0x803, 1024, 1024, 1024)
c = zlib.compressobj(9, zlib.DEFLATED, 31)
with open("lie/train-images-idx3-ubyte.gz", "wb") as f:
    f.write(c.compress(head) + c.flush(zlib.Z_FULL_FLUSH))
    f.write((c.compress(mib) + c.flush(zlib.Z_FULL_FLUSH)) * n)
    crc = zlib.crc32(head)
    for _ in range(n):
        crc = zlib.crc32(mib, crc)
    end = c.flush()
    f.write(end[:-8] + struct.pack("<II", crc, (16 + n * len(mib)) & 0xffffffff))
open("lie/train-labels-idx1-ubyte.gz", "wb").write(gzip.compress(struct.pack(">II", 0x801, 1024) + bytes(1024)))
PY
expect_fail 1 "lie/train-images-idx3-ubyte.gz: header promises 1073741824 data bytes but the gzip data holds more \(trailing data; reading stopped at 1073741825 bytes\)" \
  timeout -k 5 300 bash -c "$vlimit exec '$P' --quiet lie db"; absent db
# the same header over a few bytes of gzip: more than deflate can inflate
# them to, refused before inflating
mkdir ratio && $PY - <<'PY'
import gzip, struct
open("ratio/train-images-idx3-ubyte.gz", "wb").write(gzip.compress(struct.pack(">IIII", 0x803, 1024, 1024, 1024)))
open("ratio/train-labels-idx1-ubyte.gz", "wb").write(gzip.compress(struct.pack(">II", 0x801, 1024) + bytes(1024)))
PY
gzsize=$(stat -c %s ratio/train-images-idx3-ubyte.gz)
expect_fail 1 "ratio/train-images-idx3-ubyte.gz: header promises 1073741824 data bytes but $gzsize bytes of gzip inflate to at most $((gzsize * 1032)) \(deflate's limit is 1032:1\)" \
  timeout -k 5 300 bash -c "$vlimit exec '$P' --quiet ratio db"; absent db
# 5 GiB of images (a sparse file that holds them all): over the 4 GiB limit
# of an IDX file, refused before anything is allocated; and as gzip
mkdir cap && $PY - <<'PY'
import gzip, os, struct
head = struct.pack(">IIII", 0x803, 1280, 2048, 2048)
with open("cap/train-images-idx3-ubyte", "wb") as f:
    f.write(head)
    f.truncate(16 + 1280 * 2048 * 2048)
open("cap/train-labels-idx1-ubyte", "wb").write(struct.pack(">II", 0x801, 1280) + bytes(1280))
os.mkdir("capgz")
open("capgz/train-images-idx3-ubyte.gz", "wb").write(gzip.compress(head))
open("capgz/train-labels-idx1-ubyte", "wb").write(struct.pack(">II", 0x801, 1280) + bytes(1280))
PY
for d in cap capgz; do
  f=$(ls $d/train-images-*)
  expect_fail 1 "$f: header promises 5368709120 data bytes, over the limit of 4294967296 \(4 GiB\) for an IDX file" \
    timeout -k 5 300 bash -c "$vlimit exec '$P' --quiet $d db"; absent db
done
rm -rf lie ratio cap capgz

# --- CIFAR -------------------------------------------------------------------
mkdir cifar && head -c $((3073 * 10 + 5)) /dev/urandom > cifar/data_batch_1.bin
expect_fail 1 "cifar/data_batch_1.bin: 30735 bytes is not a whole number of 3073-byte CIFAR records" "$P" --quiet cifar db; absent db
mkdir cififo && mkfifo cififo/data_batch_1.bin
expect_fail 1 "cififo/data_batch_1.bin: not a regular file \(a FIFO\)" timeout -k 5 300 "$P" --quiet cififo db; absent db
mkdir cifmeta && mkfifo cifmeta/batches.meta.txt
for b in 1 2 3 4 5; do head -c $((3073 * 10)) /dev/urandom > cifmeta/data_batch_$b.bin; done
expect_fail 1 "cifmeta/batches.meta.txt: not a regular file \(a FIFO\)" timeout -k 5 300 "$P" --quiet cifmeta db; absent db

# --- directories ---------------------------------------------------------------
expect_fail 1 "nowhere: No such file or directory" "$P" nowhere db; absent db
touch afile
expect_fail 1 "afile: not a directory" "$P" afile db; absent db
mkdir empty
expect_fail 1 "empty: no class folders .*; it is empty\)" "$P" empty db; absent db
# DB_DIR is checked before any work (RAW_DIR "nowhere" is not even looked at)
expect_fail 2 "prep: DB_DIR is empty" "$P" good ""; absent db
expect_fail 2 "prep: RAW_DIR is empty" "$P" "" db; absent db
expect_fail 1 "prep: error: afile: not a directory" "$P" nowhere afile/db
expect_fail 1 "prep: error: afile: exists and is not a directory" "$P" nowhere afile
expect_fail 1 "prep: error: nothere: No such file or directory" "$P" nowhere nothere/db
[ "$(stat -c %s afile)" -eq 0 ] || fail "afile changed"
if [ "$(id -u)" -ne 0 ]; then
  cp -r good locked && chmod 000 locked/class4
  expect_fail 1 "locked/class4: cannot read directory: Permission denied" "$P" locked db; absent db
  chmod 755 locked/class4
else
  echo "note: running as root, the unreadable-directory case is not testable here"
fi

# --- the disk and the map fill up -----------------------------------------------
expect_fail 1 "db: writing records: .*(file size limit, ulimit -f, is 4194304 bytes|no space left)" bash -c "ulimit -f 4096; exec '$P' --quiet '$FASHION' db"; absent db
expect_fail 1 "db: database map is full at 8 MiB" "$P" --quiet --map-size 1M --map-max 8M "$FASHION" db; absent db
"$P" --quiet --map-size 1M "$FASHION" grown >/dev/null || fail "map did not grow from 1 MiB"
is_complete grown || fail "grown database incomplete"
ok "map grew from 1 MiB to hold Fashion-MNIST"

# --- existing databases ----------------------------------------------------------
before=$(md5sum grown/data.mdb)
expect_fail 1 "grown: holds a complete stoke database; pass --force to replace it" "$P" --quiet good grown
[ "$(md5sum grown/data.mdb)" = "$before" ] || fail "refused run changed the database"
"$P" --quiet --force good grown >/dev/null
"$STK_BIN/dbinfo" grown | grep -q "split train: 200 records" || fail "--force did not replace"
ok "--force replaced the database"
mkdir foreign && echo precious > foreign/notes.txt
expect_fail 1 "foreign: holds files other than data.mdb/lock.mdb; refusing" "$P" --quiet --force good foreign
[ "$(cat foreign/notes.txt)" = precious ] || fail "foreign dir touched"

# --- flags -------------------------------------------------------------------
expect_fail 2 "--workers: expected a whole number 1..256, got '0'" "$P" --workers 0 good db
expect_fail 2 "--workers: expected a whole number 1..256, got 'two'" "$P" --workers two good db
expect_fail 2 "--size: expected a whole number 1..4096, got '-3'" "$P" --size -3 good db
expect_fail 2 "--format: expected idx, cifar or folder, got 'tar'" "$P" --format tar good db
expect_fail 2 "--map-max: expected a size in bytes" "$P" --map-max lots good db
# flags that exclude or need each other are bad usage, as in train and sweep
expect_fail 2 "prep: --quality needs --encode jpeg" "$P" --quality 80 good db
expect_fail 2 "prep: --size crops to a square, --short-side/--max-side keep the aspect ratio: give one or the other" "$P" --size 32 --short-side 48 good db
expect_fail 2 "prep: --size crops to a square" "$P" --max-side 64 --size 32 good db
expect_fail 2 "prep: --max-side 20 is below --short-side 48" "$P" --short-side 48 --max-side 20 good db
expect_fail 2 "prep: --upscale needs --short-side" "$P" --upscale good db
expect_fail 2 "unknown option '--frobnicate'" "$P" --frobnicate good db
expect_fail 2 "--workers needs a value" "$P" good db --workers
expect_fail 2 "expected RAW_DIR and DB_DIR" "$P" good
expect_fail 2 "unknown option '--bogus'" "$STK_BIN/dbinfo" --bogus grown
expect_fail 2 "--split: no split \"val\"" "$STK_BIN/dbinfo" --split val grown
absent db

# --- outputs: a regular file or nothing there; a FIFO is refused, never
# waited on (timeout: if opening it blocks again, this fails instead of
# hanging the suite); a regular file is replaced
mkfifo sheet.fifo && mkdir sheet.dir
expect_fail 1 "dbinfo: error: sheet.fifo: not a regular file \(a FIFO\)" timeout -k 5 300 "$STK_BIN/dbinfo" grown --grid sheet.fifo
expect_fail 1 "dbinfo: error: sheet.dir: not a regular file \(a directory\)" timeout -k 5 300 "$STK_BIN/dbinfo" grown --grid sheet.dir
[ -p sheet.fifo ] && [ -d sheet.dir ] || fail "a refused --grid replaced its target"
[ -z "$(timeout -k 5 300 "$STK_BIN/dbinfo" grown --grid sheet.fifo 2> /dev/null)" ] \
  || fail "a refused --grid printed the report first"
head -c 100000 /dev/urandom > sheet.png
"$STK_BIN/dbinfo" grown --grid sheet.png >/dev/null
$PY -c "from PIL import Image; im = Image.open('sheet.png'); im.load(); assert im.size[0] > 100, im.size" || fail "--grid over a regular file"
ok "--grid refuses a FIFO and a directory, replaces a regular file"
rm -rf sheet.fifo sheet.dir sheet.png

# --- SOURCE_DATE_EPOCH: whole seconds since 1970, or refused ------------------
for v in abc 1.5 -1 " 12" 12abc 0x10 253402300800 99999999999999999999; do
  expect_fail 2 "prep: SOURCE_DATE_EPOCH: expected whole seconds since 1970 \(0\.\.253402300799\), got '$v'" \
    env SOURCE_DATE_EPOCH="$v" "$P" --quiet good db; absent db
done
for v in 0:1970-01-01T00:00:00Z 1700000000:2023-11-14T22:13:20Z 253402300799:9999-12-31T23:59:59Z; do
  SOURCE_DATE_EPOCH=${v%%:*} "$P" --quiet good sde >/dev/null
  meta_py sde "assert meta['created'] == '${v#*:}', meta['created']" || fail "SOURCE_DATE_EPOCH=${v%%:*}"
  rm -rf sde
done
ok "SOURCE_DATE_EPOCH checked"

# --- Ctrl-C and SIGTERM: exit 130 at any point, nothing left behind ------------
# (as soon as prep catches them, while it reads the IDX files; and once its
# partial database exists, while it writes records)
# No fixed deadlines (under the sanitizers on a loaded machine prep can be
# slow to get there): each waits as long as prep lives, and fails if prep
# ended first.
caught() { # waits until process $1's main thread blocks SIGINT and SIGTERM
  # (from then on they wait for its watcher thread, stk-signals)
  local m
  while kill -0 "$1" 2>/dev/null; do
    m=$(awk '/^SigBlk:/ {print $2}' "/proc/$1/status" 2>/dev/null || true)
    [ -n "$m" ] && (( (0x$m & 0x4002) == 0x4002 )) && return 0
    sleep 0.01
  done
  fail "prep ended before it blocked SIGINT and SIGTERM"
}
reading() { :; } # caught returns while prep reads the IDX files
writing() { # waits until prep ($1) has created its partial database
  while kill -0 "$1" 2>/dev/null; do
    [ -d .sigdb.partial ] && return 0
    sleep 0.005
  done
  fail "prep ended before it was seen writing .sigdb.partial"
}
for sig in INT TERM; do
  for at in reading writing; do
    "$P" --workers 1 --quiet --gray --size 40 "$FASHION" sigdb & pid=$!
    caught $pid; $at $pid; kill -$sig $pid; rc=0; wait $pid || rc=$?
    [ $rc -eq 130 ] || fail "SIG$sig once $at: exit $rc, expected 130"
    absent sigdb
  done
done
ok "SIGINT and SIGTERM exit 130"
ok "all bad inputs refused"
