#!/usr/bin/env bash
# Installs the Debian packages stoke needs, when they are missing.
#   scripts/deps.sh build   compiler, CMake and libraries
#   scripts/deps.sh test    build + data + what the tests use
#   scripts/deps.sh bench   test + the peers the benchmarks run
set -euo pipefail
level=${1:-test}

build=(build-essential cmake pkg-config liblmdb-dev libuv1-dev
       libopenblas-dev zlib1g-dev libcjson-dev libturbojpeg0-dev libspng-dev
       libcmocka-dev python3-dev dataset-fashion-mnist)
test=(python3 python3-lmdb python3-numpy python3-pil lmdb-utils python3-torch
      python3-torchvision python3-skimage python3-sklearn)
bench=(hyperfine)

want=("${build[@]}")
case $level in
build) ;;
test) want+=("${test[@]}") ;;
bench) want+=("${test[@]}" "${bench[@]}") ;;
*) echo "deps.sh: expected build, test or bench, got '$level'" >&2; exit 2 ;;
esac

missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
    || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "deps.sh: installing ${missing[*]}" >&2
sudo=()
[ "$(id -u)" -eq 0 ] || sudo=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
