#!/usr/bin/env bash
# valgrind.sh - memcheck over unit test programs, for threaded and I/O work
# before it is called done (not in CI; the default set takes about 70 s on
# 2 vCPUs, test_trainer 8 minutes more).
#
#   scripts/valgrind.sh [--build DIR] [TEST ...]
#
# TEST: programs in DIR/bin (default build), by default test_loader,
# test_store, test_sources, test_image and test_upload. Each runs under
# `valgrind --error-exitcode=9 --leak-check=full` with its own scratch
# directory; a line per program says ok or FAIL, with the log's path.
# --fair-sched=yes: valgrind runs one thread at a time, and without a fair
# turn a test that polls (timed waits of a microsecond) starved the workers
# it waited for for minutes. A program whose GPU cases skip (exit 77:
# test_distributed) stops at the first; run its cases one by one.
# JSIMD_FORCENONE=1: libjpeg-turbo's SIMD decoders write bytes memcheck
# cannot prove defined (215 reports in test_loader's JPEG cases, none
# with the plain C decoders), which would bury real ones;
# scripts/valgrind.supp holds the reports that are glibc's.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$SRC/build
if [ "${1:-}" = --build ]; then
  BUILD=$(cd "${2:?--build needs a directory}" && pwd)
  shift 2
fi
command -v valgrind >/dev/null ||
  { echo "valgrind.sh: valgrind not found (apt-get install -y valgrind)" >&2; exit 2; }
[ $# -gt 0 ] || set -- test_loader test_store test_sources test_image test_upload
LOGS=$(mktemp -d)
failed=0
for t in "$@"; do
  exe=$BUILD/bin/$t
  [ -x "$exe" ] || { echo "valgrind.sh: $exe not found (build first)" >&2; exit 2; }
  start=$SECONDS
  if STK_TMP=$LOGS/$t.tmp JSIMD_FORCENONE=1 valgrind -q --error-exitcode=9 \
       --fair-sched=yes --leak-check=full --errors-for-leak-kinds=definite \
       --suppressions="$SRC/scripts/valgrind.supp" "$exe" >"$LOGS/$t.log" 2>&1; then
    echo "ok: $t ($((SECONDS - start)) s)"
  else
    echo "FAIL: $t ($((SECONDS - start)) s): $LOGS/$t.log"
    failed=1
  fi
done
exit $failed
