#!/usr/bin/env bash
# gpu_pack.sh - packs a CUDA build for a GPU machine that lacks the Debian
# libraries (a cloud image with only the CUDA toolkit, a cluster node):
#
#   scripts/gpu_pack.sh [--build DIR] [--out FILE]     here (default build-gpu,
#                                                      gpu-pack.tar.gz)
#   tar xzf gpu-pack.tar.gz && . gpu-pack/env.sh       there, in the same
#                                                      checkout (same commit)
#   scripts/gpu_check.sh --build "$STK_PACK_BUILD"
#
# The pack holds the build's binaries, test files and CTest scripts (no
# objects, no test scratch, debug info stripped), the shared libraries they
# need that are not part of the C runtime or CUDA (LMDB, libuv, OpenBLAS,
# TurboJPEG, spng, ...), Fashion-MNIST's IDX files and Debian's sample
# photographs. CTest records absolute paths: env.sh rewrites them to the
# unpacked build and the checkout it finds. The CUDA runtime,
# cuBLAS and NCCL come from the GPU machine.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$SRC/build-gpu OUT=gpu-pack.tar.gz
while [ $# -gt 0 ]; do
  case $1 in
  --build) BUILD=${2:?--build needs a directory}; shift 2 ;;
  --out) OUT=${2:?--out needs a file}; shift 2 ;;
  *) echo "gpu_pack.sh: unknown argument '$1' (expected --build DIR, --out FILE)" >&2; exit 2 ;;
  esac
done
FASHION=${STK_FASHION:-/usr/share/datasets/fashion-mnist}
[ -x "$BUILD/bin/train" ] || { echo "gpu_pack.sh: $BUILD/bin/train not found: build first (scripts/build.sh or cmake -B $BUILD -DSTK_CUDA=ON)" >&2; exit 1; }
grep -q '^CMAKE_CUDA_COMPILER:' "$BUILD/CMakeCache.txt" ||
  { echo "gpu_pack.sh: $BUILD was configured without CUDA" >&2; exit 1; }
ls "$FASHION"/*-ubyte* >/dev/null 2>&1 ||
  { echo "gpu_pack.sh: no Fashion-MNIST IDX files in $FASHION (install dataset-fashion-mnist or set STK_FASHION)" >&2; exit 1; }
# paths as given, from where the script was run; then the checkout's root
BUILD=$(cd "$BUILD" && pwd) FASHION=$(cd "$FASHION" && pwd)
mkdir -p "$(dirname "$OUT")" && OUT=$(cd "$(dirname "$OUT")" && pwd)/$(basename "$OUT") ||
  { echo "gpu_pack.sh: --out $OUT: cannot make its folder" >&2; exit 1; }
cd "$SRC"
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
P=$STAGE/gpu-pack
mkdir -p "$P/lib" "$P/fashion-mnist"

# the build without objects, then its ELF files stripped of debug info
(cd "$BUILD" && find . \( -name CMakeFiles -o -path ./tests/tmp -o -path ./Testing \) -prune \
  -o -name '*.o' -o -name '*.a' -o -type f -print | tar cf - -T -) | (mkdir -p "$P/build" && cd "$P/build" && tar xf -)
find "$P/build" -type f \( -perm -u+x -o -name '*.so' \) -exec sh -c \
  'head -c4 "$1" | grep -q ELF && strip --strip-debug "$1"; true' _ {} \;

# the libraries outside the C runtime and CUDA
for f in "$BUILD"/bin/* "$BUILD"/python/stoke/*.so; do
  [ -x "$f" ] || [ "${f%.so}" != "$f" ] || continue
  ldd "$f" 2>/dev/null || true
done | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u |
  { grep -v -E '/(libc|libm|libmvec|libdl|librt|libpthread|libresolv|libutil|ld-linux[^/]*|libgcc_s|libstdc\+\+)\.so|/cuda[^/]*/|libcuda\.so|libnccl|libcublas|libcudart' || true; } |
  while read -r lib; do cp -L "$lib" "$P/lib/"; done
cp "$FASHION"/*-ubyte* "$P/fashion-mnist/"
# the sample photographs the photo tests crop, where this machine has them
# (bench/make_photos.py's photo_path; env.sh points STK_PHOTOS at them)
mkdir -p "$P/photos"
/usr/bin/python3 - "$SRC/bench" "$P/photos" <<'PY' ||
import os, shutil, sys
sys.path.insert(0, sys.argv[1])
from make_photos import SOURCES, photo_path
for name in sorted({os.path.basename(p) for _, p in SOURCES} | {"camera.png"}):
    shutil.copy(photo_path(name), sys.argv[2])
PY
  echo "gpu_pack.sh: the sample photographs were not packed (python3-sklearn, python3-skimage): the photo tests will fail there" >&2

cat >"$P/env.sh" <<'EOF'
# sourced where the pack was unpacked: the libraries, the data, the build
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export STK_FASHION="$here/fashion-mnist"
[ -z "$(ls "$here/photos" 2>/dev/null)" ] || export STK_PHOTOS="$here/photos"
export STK_PACK_BUILD="$here/build"
# the checkout (same commit): the folder above the pack, the one above
# that (the pack unpacked in a folder of it, .gpu/), or the caller's
src=
for d in "$here/.." "$here/../.." "$PWD"; do
  [ -f "$d/tests/e2e/shim/lmdb.py" ] && { src=$(cd "$d" && pwd); break; }
done
[ -n "$src" ] || echo "gpu-pack: no checkout of stoke above $here nor at $PWD: the e2e tests need one" >&2
EOF
cat >>"$P/env.sh" <<EOF
# CTest's files name the build and the sources by the paths they had when
# packed: rewritten to the pack's build and the checkout found (the build
# first, through a marker, since it may lie inside the sources), once
if [ ! -e "\$here/build/.paths-rewritten" ]; then
  ctest_all=\$(find "\$here/build" -name CTestTestfile.cmake)
  sed -i "s#$BUILD#@STK_PACK_BUILD@#g" \$ctest_all
  [ -z "\$src" ] || sed -i "s#$SRC#\$src#g" \$ctest_all
  sed -i "s#@STK_PACK_BUILD@#\$here/build#g" \$ctest_all
  echo "\$src" > "\$here/build/.paths-rewritten"
fi
EOF
cat >>"$P/env.sh" <<'EOF'
# the Python the tests and the report run under: the first of Debian's and
# the first python3 on PATH that has numpy and torch (the parity and
# python_cuda tests need torch), else the first with numpy (STK_PYTHON,
# PYTHON: the caller's choice); CTest's files name /usr/bin/python3
py=
for want in 'numpy, torch' numpy; do
  for c in /usr/bin/python3 $(command -v python3); do
    if [ -z "$py" ] && "$c" -c "import $want" 2>/dev/null; then py=$c; fi
  done
done
py=${py:-/usr/bin/python3}
export STK_PYTHON="${STK_PYTHON:-$py}" PYTHON="${PYTHON:-${STK_PYTHON:-$py}}"
ctest_files=$(grep -rl PYTHONPATH= "$here/build" --include=CTestTestfile.cmake)
[ "$STK_PYTHON" = /usr/bin/python3 ] ||
  sed -i "s#\"/usr/bin/python3\"#\"$STK_PYTHON\"#g" $ctest_files # quoted: once
# python3-lmdb, the tests' independent reader: where that Python lacks it,
# tests/e2e/shim/lmdb.py (its API over liblmdb) first on their PYTHONPATH
shim=$src/tests/e2e/shim
if "$STK_PYTHON" -c 'import lmdb' 2>/dev/null; then
  echo "gpu-pack: tests under $STK_PYTHON"
elif [ -z "$src" ]; then
  echo "gpu-pack: tests under $STK_PYTHON, which lacks python3-lmdb (no checkout: no shim)"
else
  grep -L "PYTHONPATH=$shim:" $ctest_files | xargs -r sed -i "s#PYTHONPATH=#PYTHONPATH=$shim:#"
  echo "gpu-pack: tests under $STK_PYTHON, python3-lmdb from tests/e2e/shim"
fi
unset here src d ctest_all py ctest_files shim want c
EOF
tar czf "$OUT" -C "$STAGE" gpu-pack
echo "gpu_pack.sh: $OUT ($(du -h "$OUT" | cut -f1)): $(ls "$P/lib" | wc -l) libraries, $(ls "$P/build/bin" | wc -l) programs"
