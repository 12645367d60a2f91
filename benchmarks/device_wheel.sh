#!/usr/bin/env bash
# On the lent GPU machine: the CUDA wheel from the objects of benchmarks/device_build.sh (run it
# first, same environment), checked and installed into a fresh venv holding only torch by
# tools/check_wheel.py, which also runs a bf16 flash attention on the GPU from the installed
# wheel. Writes the wheel to ${OUT:-/tmp}/dist and prints the wheel build's time (link and
# packaging only when device_build.sh's objects are up to date).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dist="${OUT:-/tmp}/dist"
rm -rf "$dist" build/lib.*
start=$(date +%s)
CC=/usr/bin/gcc CXX=/usr/bin/g++ ADAATTN_CUDA_ARCHS="${ADAATTN_CUDA_ARCHS:-90a}" MAX_JOBS="${MAX_JOBS:-16}" \
  python3 -m pip wheel -q --no-build-isolation --no-deps -w "$dist" .
echo "[device_wheel] wheel build $(( $(date +%s) - start ))s: $(ls -s --block-size=M "$dist")"
python3 tools/check_wheel.py "$dist"/adaattn-*.whl
