#!/usr/bin/env bash
# Runs the free-threading stress tests under ThreadSanitizer: a free-threaded CPython 3.13 built with
# --with-thread-sanitizer (clang; built once into ~/.cache/cai-dlpack/python3.13t-tsan by
# .ci/pythons/build-3.13t.sh --tsan, which takes Debian trixie's python3.13 source), a venv of it with numpy
# and pytest, and the extension built with -fsanitize=thread (CMake option CAI_DLPACK_TSAN). Reports go to
# build/tsan/report.<pid>; any report left after tests/tsan.supp fails the run, and the reports are printed.
# The suppressions cover frames outside csrc/ only (tests/tsan.supp says why each one is not ours).
# Run before each release, not in CI: the first run builds the interpreter (about 6 minutes on 2 cores).
# Usage: bash tests/run_tsan.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
cache=${CAI_DLPACK_CACHE:-$HOME/.cache/cai-dlpack}
build=build/tsan
command -v clang >/dev/null || { echo "$0: needs clang (Debian: apt-get install clang)" >&2; exit 1; }
base=$(bash .ci/pythons/build-3.13t.sh --tsan | tail -n 1)
venv=$cache/venv-3.13t-tsan
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import numpy, pytest" 2>/dev/null; then
  rm -rf "$venv"
  "$base" -m venv "$venv"
  # Binary wheels only (NumPy publishes cp313t ones): a source build under TSan would take far longer.
  "$venv/bin/python" -m pip install -q --only-binary=:all: numpy pytest
fi
python=$venv/bin/python
. tests/support/build_requirements.sh
find_build_requirements cmake
cmake=$cmake_binary
[ -n "$cmake" ] || missing "needs cmake (pip install cmake, or Debian: apt-get install cmake)"
mkdir -p "$build"
PYTHONPATH="${build_deps}${PYTHONPATH:+:$PYTHONPATH}" CC=clang "$cmake" -S . -B "$build" -DCMAKE_BUILD_TYPE=Debug \
  -DCAI_DLPACK_TSAN=ON -DCAI_DLPACK_WERROR=ON -DPython_EXECUTABLE="$python" >"$build.log" 2>&1 ||
  { cat "$build.log"; exit 1; }
nice "$cmake" --build "$build" -j 2 >>"$build.log" 2>&1 || { cat "$build.log"; exit 1; }
package="$build/site/cai_dlpack"
rm -rf "$build/site" && mkdir -p "$package"
"$cmake" --install "$build" --prefix "$build/site" >>"$build.log" 2>&1 || { cat "$build.log"; exit 1; }
cp python/cai_dlpack/*.py python/cai_dlpack/*.pyi python/cai_dlpack/py.typed "$package/"
rm -f "$build"/report.*
# halt_on_error=0: every race of the run is reported, each once; the reports are read after pytest.
export TSAN_OPTIONS="suppressions=$root/tests/tsan.supp log_path=$root/$build/report halt_on_error=0 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
export PYTHONPATH="$root/$build/site${PYTHONPATH:+:$PYTHONPATH}"
status=0
"$python" -m pytest -p no:cacheprovider tests/cpu/test_free_threading.py tests/cpu/test_threads_shutdown.py "$@" ||
  status=$?
reports=$(ls "$build"/report.* 2>/dev/null || true)
if [ -n "$reports" ]; then
  cat $reports >&2
  echo "$0: ThreadSanitizer reported (above; files: $build/report.*)" >&2
  exit 1
fi
exit "$status"
