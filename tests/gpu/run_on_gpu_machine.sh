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
# The toolkit's headers when it has them, else CMakeLists.txt looks in the nvidia-cuda-runtime/-crt wheels;
# dlpack.h straight from the carried apache-tvm-ffi (no import of tvm_ffi, which imports torch, at configure).
toolkit=${CUDA_HOME:-/usr/local/cuda}
if [ ! -f "$toolkit/include/cuda_runtime_api.h" ] && command -v nvcc >/dev/null; then
  toolkit=$(dirname "$(dirname "$(command -v nvcc)")")
fi
headers=()
if [ -f "$toolkit/include/cuda_runtime_api.h" ]; then
  headers+=(-Ccmake.define.CUDAToolkit_ROOT="$toolkit")
fi
if [ -f /tmp/cai-dlpack-site/tvm_ffi/include/dlpack/dlpack.h ]; then
  headers+=(-Ccmake.define.DLPACK_INCLUDE_DIR=/tmp/cai-dlpack-site/tvm_ffi/include)
fi
# Without build isolation the machine's scikit-build-core builds: 1.0 or newer reads the version from
# python/cai_dlpack/__init__.py ([[tool.dynamic-metadata]]); carry its wheel in .whl/ where it is older.
python3 -c "import scikit_build_core as s, sys; sys.exit(int(s.__version__.split('.')[0]) < 1)" ||
  { echo "scikit-build-core >= 1.0 is needed: put its wheel in .whl/" >&2; exit 1; }
python3 -m pip install -q --no-build-isolation --no-deps ${headers[@]+"${headers[@]}"} \
  .
status=0
# A failed self-check is reported in the exit status; the suite and the benchmarks still run.
python3 -m cai_dlpack 2>&1 | tee "$out/selfcheck.log" || status=$?
PYTHONUNBUFFERED=1 python3 -m pytest tests/gpu -v -rs -s 2>&1 | tee "$out/gpu-tests.log" || status=$?
# The results (cpu.md, gpu.md and their .png) go to $out beside the logs; the committed ones are left alone.
PYTHONUNBUFFERED=1 python3 benchmarks/run_all.py --out "$out" 2>&1 | tee "$out/benchmarks.log" || status=$?
# Runtime and driver calls per conversion, counted by CUPTI (runtime_calls.md beside the others).
PYTHONUNBUFFERED=1 python3 benchmarks/runtime_calls_gpu.py --out "$out" || status=$?
exit "$status"
