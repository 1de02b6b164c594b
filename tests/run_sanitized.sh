#!/usr/bin/env bash
# Builds the extension with AddressSanitizer + UndefinedBehaviorSanitizer and runs the CPU suite with the
# ASan runtime preloaded into the interpreter; any report fails the run. Needs the build requirements
# (apache-tvm-ffi, nvidia-cuda-runtime, nvidia-cuda-crt) importable by the current python, or installed in
# a folder named by BUILD_DEPS (pip install --target DIR ...), which only the build step sees.
# Usage: bash tests/run_sanitized.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
build=build/sanitized
mkdir -p build
PYTHONPATH="${BUILD_DEPS:-}${PYTHONPATH:+:$PYTHONPATH}" cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Debug -DCAI_DLPACK_SANITIZE=ON -DCAI_DLPACK_WERROR=ON \
  -DPython_EXECUTABLE="$("$python" -c 'import sys; print(sys.executable)')" >"$build.log" 2>&1 || { cat "$build.log"; exit 1; }
cmake --build "$build" -j 2 >>"$build.log" 2>&1 || { cat "$build.log"; exit 1; }
package="$build/site/cai_dlpack"
rm -rf "$build/site" && mkdir -p "$package"
# Laid out as a wheel is: the module and the C API's headers (CMake's install), the Python files and stubs.
cmake --install "$build" --prefix "$build/site" >>"$build.log" 2>&1 || { cat "$build.log"; exit 1; }
cp python/cai_dlpack/*.py python/cai_dlpack/*.pyi python/cai_dlpack/py.typed "$package/"
asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
# Leak checking is off: CPython keeps interned objects alive to the end by design. Leaks of ours are
# caught by the suite's reference-count and resident-size checks instead.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export PYTHONPATH="$PWD/$build/site${PYTHONPATH:+:$PYTHONPATH}"
export LD_PRELOAD="$asan:$ubsan"
exec "$python" -m pytest -p no:cacheprovider tests/cpu "$@"
