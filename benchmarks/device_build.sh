#!/usr/bin/env bash
# Builds the extension in place on the lent GPU machine (sm_90a only, 16 jobs) and writes the
# build log to ${OUT:-/tmp}/build.log. The system gcc, not /opt/gcc's wrapper there, which links
# libstdc++ statically: torch cannot catch such a library's exceptions (README, build knobs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
log="${OUT:-/tmp}/build.log"
start=$(date +%s)
CC=/usr/bin/gcc CXX=/usr/bin/g++ ADAATTN_CUDA_ARCHS="${ADAATTN_CUDA_ARCHS:-90a}" MAX_JOBS="${MAX_JOBS:-16}" \
  python3 setup.py build_ext --inplace >"$log" 2>&1 || { tail -50 "$log"; exit 1; }
ldd adaattn/_C*.so | grep -q libstdc++ || { echo "adaattn/_C links libstdc++ statically"; exit 1; }
echo "[device_build] $(( $(date +%s) - start ))s"
