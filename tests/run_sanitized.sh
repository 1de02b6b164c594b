#!/usr/bin/env bash
# Builds the extension with AddressSanitizer + UndefinedBehaviorSanitizer and runs the CPU suite with the
# ASan runtime preloaded into the interpreter; any report fails the run, and so does a suite that imported
# another build of the module (tests/conftest.py checks where it came from and that it is instrumented). The build requirements come from
# BUILD_DEPS, the current python or a cache it fills once (tests/support/build_requirements.sh says which);
# only the build step sees them. Needs gcc with its sanitizer runtimes, cmake (installed into that cache
# where the machine has none), and the suite's own requirements (pip install ".[test]").
# Usage: bash tests/run_sanitized.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
build=build/sanitized
. tests/support/build_requirements.sh

command -v gcc >/dev/null || missing "needs gcc with its sanitizer runtimes (Debian: apt-get install gcc)"
asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
[ -f "$asan" ] && [ -f "$ubsan" ] ||
  missing "gcc has no AddressSanitizer or UBSan runtime (Debian: apt-get install libasan8 libubsan1)"
"$python" -c "import pytest" 2>/dev/null ||
  missing "$python has no pytest; install the test requirements first: $python -m pip install \".[test]\""
find_build_requirements cmake
cmake=$cmake_binary
[ -n "$cmake" ] || missing "needs cmake (pip install cmake, or Debian: apt-get install cmake)"
mkdir -p build
PYTHONPATH="${build_deps}${PYTHONPATH:+:$PYTHONPATH}" "$cmake" -S . -B "$build" -DCMAKE_BUILD_TYPE=Debug -DCAI_DLPACK_SANITIZE=ON -DCAI_DLPACK_WERROR=ON \
  -DPython_EXECUTABLE="$("$python" -c 'import sys; print(sys.executable)')" >"$build.log" 2>&1 || { cat "$build.log"; exit 1; }
"$cmake" --build "$build" -j 2 >>"$build.log" 2>&1 || { cat "$build.log"; exit 1; }
package="$build/site/cai_dlpack"
rm -rf "$build/site" && mkdir -p "$package"
# Laid out as a wheel is: the module and the C API's headers (CMake's install), the Python files and stubs.
"$cmake" --install "$build" --prefix "$build/site" >>"$build.log" 2>&1 || { cat "$build.log"; exit 1; }
cp python/cai_dlpack/*.py python/cai_dlpack/*.pyi python/cai_dlpack/py.typed "$package/"
# Leak checking is off: CPython keeps interned objects alive to the end by design. Leaks of ours are
# caught by the suite's reference-count and resident-size checks instead. An allocation no memory can hold
# returns NULL, as malloc does without ASan: the suite checks that the allocators refuse it.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export PYTHONPATH="$PWD/$build/site${PYTHONPATH:+:$PYTHONPATH}"
# The suite refuses to run unless it imported this build, instrumented (tests/conftest.py checks both).
export CAI_DLPACK_EXPECTED_BUILD="$PWD/$package"
export LD_PRELOAD="$asan:$ubsan"
exec "$python" -m pytest -p no:cacheprovider tests/cpu "$@"
