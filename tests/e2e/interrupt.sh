#!/usr/bin/env bash
# A database is complete or absent. kill -9 mid-run leaves nothing at DB_DIR
# (only a stale .NAME.partial that no reader accepts); the next run removes
# it and gives the same database as an uninterrupted run. SIGINT stops
# cleanly (exit 130, partial removed). A forced rebuild that is killed keeps
# the old complete database.
source "$STK_SRC/tests/e2e/lib.sh"
export SOURCE_DATE_EPOCH=1700000000
# A slow job (about 140 MB in three 64 MB transactions): Fashion-MNIST
# upscaled to 40x40 on one worker.
slow=(--workers 1 --quiet --gray --size 40 "$FASHION")

# wait_partial NAME PID: waits until the run has committed records to
# .NAME.partial. No fixed deadline (under the sanitizers on a loaded machine
# the first commit can take half a minute): it waits as long as the run
# lives, and fails if the run ended before it was seen writing.
wait_partial() {
  for _ in $(seq 30000); do
    [ -s ".$1.partial/data.mdb" ] && [ "$(stat -c %s ".$1.partial/data.mdb")" -gt 2000000 ] && return 0
    kill -0 "$2" 2>/dev/null || fail "prep ended before it was seen writing .$1.partial"
    sleep 0.02
  done
  fail "prep never started writing"
}

"$STK_BIN/prep" "${slow[@]}" db & pid=$!
wait_partial db $pid
kill -9 $pid; wait $pid 2>/dev/null || true
[ ! -e db ] || fail "db exists after kill -9"
[ -d .db.partial ] || fail "expected the stale partial directory"
is_complete .db.partial && fail "a reader accepts the killed run's partial database"
expect_fail 1 "incomplete|no stoke metadata" "$STK_BIN/dbinfo" .db.partial
ok "kill -9 left no database and an unreadable partial"

"$STK_BIN/prep" "${slow[@]}" db
[ ! -e .db.partial ] || fail "stale partial not removed"
is_complete db || fail "rerun did not produce a complete database"
"$STK_BIN/prep" "${slow[@]}" clean
cmp db/data.mdb clean/data.mdb || fail "rerun after kill differs from an uninterrupted run"
ok "rerun after kill -9 equals an uninterrupted run"

rm -rf db
"$STK_BIN/prep" "${slow[@]}" db & pid=$!
wait_partial db $pid
kill -INT $pid; rc=0; wait $pid || rc=$?
[ $rc -eq 130 ] || fail "SIGINT: exit $rc, expected 130"
[ ! -e db ] && [ ! -e .db.partial ] || fail "SIGINT left files behind"
ok "SIGINT: exit 130, nothing left"

"$STK_BIN/prep" --quiet "$FASHION" old
before=$(md5sum old/data.mdb)
"$STK_BIN/prep" --force "${slow[@]}" old & pid=$!
wait_partial old $pid
kill -9 $pid; wait $pid 2>/dev/null || true
[ "$(md5sum old/data.mdb)" = "$before" ] || fail "killed --force run damaged the old database"
is_complete old || fail "old database no longer complete"
ok "a killed --force run keeps the old complete database"
