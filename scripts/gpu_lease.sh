#!/usr/bin/env bash
# gpu_lease.sh - a short GPU lease in one command (docs/gpu.md):
#
#   scripts/gpu_lease.sh OUT [SECONDS]
#
# On a GPU machine that holds this checkout and .gpu/gpu-pack.tar.gz
# (scripts/gpu_pack.sh, made on a machine with stoke's libraries): unpacks
# the pack, runs gpu_check.sh within about 60% of SECONDS (default 480),
# then the e2e tests that gpu_check.sh did not run (all but the `cuda`
# ones), with what time is left. Leaves four files in OUT (made first, so
# they are there whatever fails; a lease returns few files): report.md
# (gpu_check's report, then the e2e summary, or why nothing ran),
# check-log.txt, e2e-log.txt (the failures' output) and bench.tar.gz (the
# benchmarks' JSON). Exit: gpu_check's (77: no GPU), else the e2e run's.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_lease.sh OUT [SECONDS]} total=${2:-480}
case $total in '' | *[!0-9]*) echo "gpu_lease.sh: SECONDS must be a whole number, not '$total'" >&2; exit 2 ;; esac
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2 # as given, from here
cd "$(dirname "$0")/.."
start=$SECONDS
R=$OUT/report.md
: >"$R"; : >"$OUT/check-log.txt"; : >"$OUT/e2e-log.txt"
tar czf "$OUT/bench.tar.gz" -T /dev/null
stop() { echo "gpu_lease.sh: $1" | tee -a "$R" >&2; exit "$2"; }
# a pack newer than its unpacked copy (a warm machine keeps files) is
# unpacked again
[ -f .gpu/gpu-pack.tar.gz ] || [ -f .gpu/gpu-pack/env.sh ] ||
  stop "no .gpu/gpu-pack.tar.gz (scripts/gpu_pack.sh makes it)" 2
if [ .gpu/gpu-pack.tar.gz -nt .gpu/gpu-pack/env.sh ]; then
  rm -rf .gpu/gpu-pack
  # -m: unpacked files dated now, so the pack is newer only once replaced
  tar xzmf .gpu/gpu-pack.tar.gz -C .gpu || stop "cannot unpack .gpu/gpu-pack.tar.gz" 2
fi
. .gpu/gpu-pack/env.sh
# two rounds of the benchmarks: enough for a median beside the first
export STK_GPU_ROUNDS=${STK_GPU_ROUNDS:-2} STK_GPU_CHECK_SECONDS=$((total * 6 / 10))
scripts/gpu_check.sh --build "$STK_PACK_BUILD" --out "$OUT/check" >/dev/null
rc=$? # its report is printed below, once
cp "$OUT/check/report.md" "$R" 2>/dev/null
mv "$OUT/check/log.txt" "$OUT/check-log.txt" 2>/dev/null
(cd "$OUT/check" && tar czf "$OUT/bench.tar.gz" --ignore-failed-read ./*.json 2>/dev/null)
rm -rf "$OUT/check"
if [ $rc -eq 77 ]; then cat "$R"; exit 77; fi
left=$((total - (SECONDS - start) - 15))
{
  echo
  echo "## e2e (all but the cuda tests), $left s allowed"
  echo
} >>"$R"
if [ $left -lt 60 ]; then
  echo "not run: out of time" >>"$R"
  exit $rc
fi
# -j4: each training test takes every CPU; more at once slows the ones
# that time a signal
timeout -k 5 "$left" ctest --test-dir "$STK_PACK_BUILD" -L e2e -LE cuda -j4 \
  --output-on-failure >"$OUT/e2e-log.txt" 2>&1
e2e=$?
{
  grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|Not Run|\*\*\*" "$OUT/e2e-log.txt" | tail -40
  [ $e2e -ne 124 ] || echo "**stopped at the time limit** (exit 124)"
} >>"$R"
cat "$R"
[ $rc -ne 0 ] && exit $rc
exit $e2e
