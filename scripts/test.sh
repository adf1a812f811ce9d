#!/usr/bin/env bash
# Builds stoke with warnings as errors and runs every test (ctest).
# Extra arguments go to ctest, e.g. scripts/test.sh -L unit
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh test
scripts/build.sh -DSTK_WERROR=ON
cd build
ctest --output-on-failure -j "$(nproc)" "$@"
