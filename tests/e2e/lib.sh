# lib.sh - sourced by the end-to-end scripts. ctest sets STK_BIN (the built
# tools), STK_SRC (the source tree) and STK_TMP (this test's scratch dir).
set -euo pipefail
: "${STK_BIN:?run through ctest}" "${STK_SRC:?}" "${STK_TMP:?}"
# Debian's python3 (numpy, torch) and Fashion-MNIST, unless the caller points
# elsewhere (scripts/gpu_check.sh on a machine without Debian's packages)
PY=${STK_PYTHON:-/usr/bin/python3}
FASHION=${STK_FASHION:-/usr/share/datasets/fashion-mnist}
export PYTHONPATH="$STK_SRC/tests/e2e${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
rm -rf "$STK_TMP" && mkdir -p "$STK_TMP" && cd "$STK_TMP"

fail() { echo "FAIL: $*" >&2; exit 1; }
ok() { echo "ok: $*"; }

[ -d "$FASHION" ] || fail "$FASHION is missing (scripts/deps.sh installs dataset-fashion-mnist)"

# A sanitizer's report anywhere in a tool's output fails the test, whatever
# the exit code: under ASan a use-after-free on an error path would otherwise
# pass as a clean refusal.
SAN_REPORT='ERROR: (Address|Leak|Thread|Memory)Sanitizer|WARNING: ThreadSanitizer|runtime error: |SUMMARY: UndefinedBehaviorSanitizer'
no_sanitizer_report() {
  if grep -Eq -- "$SAN_REPORT" <<<"$2"; then
    fail "sanitizer report from '$1':"$'\n'"$2"
  fi
}

# expect_fail CODE PATTERN CMD...: CMD must exit with exactly CODE (the
# documented one: 1 the work failed, 2 bad usage, 130 interrupted) and print
# PATTERN (an extended regex) on stderr or stdout, and no sanitizer report.
expect_fail() {
  local code=$1 pat=$2; shift 2
  local out rc=0
  out=$("$@" 2>&1) || rc=$?
  no_sanitizer_report "$*" "$out"
  [ "$rc" -ne 0 ] || fail "expected failure, got success: $*"$'\n'"$out"
  [ "$rc" -eq "$code" ] || fail "expected exit $code, got $rc: $*"$'\n'"$out"
  grep -Eq -- "$pat" <<<"$out" || fail "output of '$*' lacks /$pat/:"$'\n'"$out"
  echo "ok: refused ($rc): $(head -1 <<<"$out")"
}

# is_complete DIR: a stoke reader accepts DIR
is_complete() { "$STK_BIN/dbinfo" "$1" >/dev/null 2>&1; }
