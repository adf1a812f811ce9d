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

# --- CIFAR -------------------------------------------------------------------
mkdir cifar && head -c $((3073 * 10 + 5)) /dev/urandom > cifar/data_batch_1.bin
expect_fail 1 "cifar/data_batch_1.bin: 30735 bytes is not a whole number of 3073-byte CIFAR records" "$P" --quiet cifar db; absent db

# --- directories ---------------------------------------------------------------
expect_fail 1 "nowhere: No such file or directory" "$P" nowhere db; absent db
touch afile
expect_fail 1 "afile: not a directory" "$P" afile db; absent db
mkdir empty
expect_fail 1 "empty: no class folders" "$P" empty db; absent db
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
expect_fail 2 "unknown option '--frobnicate'" "$P" --frobnicate good db
expect_fail 2 "--workers needs a value" "$P" good db --workers
expect_fail 2 "expected RAW_DIR and DB_DIR" "$P" good
expect_fail 2 "unknown option '--bogus'" "$STK_BIN/dbinfo" --bogus grown
expect_fail 2 "--split: no split \"val\"" "$STK_BIN/dbinfo" --split val grown
absent db
ok "all bad inputs refused"
