#!/usr/bin/env bash
# Builds the extension in place on the lent GPU machine (sm_90a only, 16 jobs) and writes the
# build log, with the kernels' register/spill report, to ${OUT:-/tmp}/build.log.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
log="${OUT:-/tmp}/build.log"
start=$(date +%s)
ADAATTN_CUDA_ARCHS="${ADAATTN_CUDA_ARCHS:-90a}" MAX_JOBS="${MAX_JOBS:-16}" \
  python3 setup.py build_ext --inplace >"$log" 2>&1 || { tail -50 "$log"; exit 1; }
echo "[device_build] $(( $(date +%s) - start ))s"
