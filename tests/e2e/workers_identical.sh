#!/usr/bin/env bash
# The database is byte-identical whatever the number of workers: data.mdb of
# --workers 1 and --workers 8 compare equal, for IDX and for a JPEG folder
# (with a fixed SOURCE_DATE_EPOCH, the only varying metadata).
source "$STK_SRC/tests/e2e/lib.sh"
export SOURCE_DATE_EPOCH=1700000000
$PY "$STK_SRC/tests/e2e/make_folder.py" jpegs 3000 64
for w in 1 8; do
  "$STK_BIN/prep" --quiet --workers $w "$FASHION" fashion_w$w
  "$STK_BIN/prep" --quiet --workers $w --size 32 jpegs jpegs_w$w
done
cmp fashion_w1/data.mdb fashion_w8/data.mdb || fail "IDX: 1 and 8 workers differ"
cmp jpegs_w1/data.mdb jpegs_w8/data.mdb || fail "folder: 1 and 8 workers differ"
[ "$(stat -c %s jpegs_w1/data.mdb)" -gt 3000000 ] || fail "folder db is too small"
ok "1 and 8 workers give identical data.mdb (IDX $(stat -c %s fashion_w1/data.mdb) B, folder $(stat -c %s jpegs_w1/data.mdb) B)"
