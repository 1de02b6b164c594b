#!/usr/bin/env bash
# One command for a GPU machine without network access: install carried wheels (apache-tvm-ffi, in .whl/),
# build against the machine's CUDA toolkit, run the GPU suite, then the benchmarks (CPU and GPU parts).
# Logs and result files go to $OUT when set, else to the current folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-.}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/cai-dlpack-site .whl/*.whl
  export PYTHONPATH=/tmp/cai-dlpack-site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-build-isolation --no-deps \
  -Ccmake.define.CUDAToolkit_ROOT="${CUDA_HOME:-/usr/local/cuda}" -Ccmake.define.CAI_DLPACK_WERROR=ON .
python3 -m cai_dlpack | tee "$out/selfcheck.log"
status=0
PYTHONUNBUFFERED=1 python3 -m pytest tests/gpu -v -rs -s 2>&1 | tee "$out/gpu-tests.log" || status=$?
PYTHONUNBUFFERED=1 python3 benchmarks/run_all.py 2>&1 | tee "$out/benchmarks.log" || status=$?
cp benchmarks/results/*.md benchmarks/results/*.png "$out"/ 2>/dev/null || true
exit "$status"
