# lib.sh - sourced by the end-to-end scripts. ctest sets STK_BIN (the built
# tools), STK_SRC (the source tree) and STK_TMP (this test's scratch dir).
set -euo pipefail
: "${STK_BIN:?run through ctest}" "${STK_SRC:?}" "${STK_TMP:?}"
PY=/usr/bin/python3
FASHION=/usr/share/datasets/fashion-mnist
export PYTHONPATH="$STK_SRC/tests/e2e${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
rm -rf "$STK_TMP" && mkdir -p "$STK_TMP" && cd "$STK_TMP"

fail() { echo "FAIL: $*" >&2; exit 1; }
ok() { echo "ok: $*"; }

[ -d "$FASHION" ] || fail "$FASHION is missing (scripts/deps.sh installs dataset-fashion-mnist)"

# expect_fail PATTERN CMD...: CMD must exit non-zero and print PATTERN
# (an extended regex) on stderr or stdout.
expect_fail() {
  local pat=$1; shift
  local out rc=0
  out=$("$@" 2>&1) || rc=$?
  [ "$rc" -ne 0 ] || fail "expected failure, got success: $*"$'\n'"$out"
  grep -Eq -- "$pat" <<<"$out" || fail "output of '$*' lacks /$pat/:"$'\n'"$out"
  echo "ok: refused ($rc): $(head -1 <<<"$out")"
}

# is_complete DIR: a stoke reader accepts DIR
is_complete() { "$STK_BIN/dbinfo" "$1" >/dev/null 2>&1; }
