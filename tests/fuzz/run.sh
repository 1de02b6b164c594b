#!/usr/bin/env bash
# Builds the libFuzzer target (clang with -fsanitize=fuzzer,address,undefined; Debian: clang-14 and
# libclang-rt-14-dev) and runs it on tests/fuzz/corpus. The build requirements come from BUILD_DEPS, the
# current python or a cache it fills once (tests/support/build_requirements.sh says which).
# Usage: bash tests/fuzz/run.sh [seconds]
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-60}
python=${PYTHON:-python3}
. tests/support/build_requirements.sh
debian="Debian: apt-get install clang-14 libclang-rt-14-dev"
clang=$(command -v clang || command -v clang-14 || true)
[ -n "$clang" ] || missing "needs clang with libFuzzer ($debian)"
pyinc=$("$python" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
[ -f "$pyinc/Python.h" ] ||
  missing "$python has no Python.h to build against (Debian: apt-get install python3-dev)"
find_build_requirements
run_python() { PYTHONPATH="${build_deps}${PYTHONPATH:+:$PYTHONPATH}" "$python" -c "$1"; }
dlpack=$(run_python "import tvm_ffi.libinfo as l; print(l.find_dlpack_include_path())")
cuda=$(run_python "import nvidia, os
print(next(d for p in nvidia.__path__ for d in (os.path.join(p, s, 'include') for s in ('cu13', 'cuda_runtime'))
           if os.path.exists(os.path.join(d, 'cuda_runtime_api.h'))))")
cudart_major=$(awk '/^#define CUDART_VERSION/ {print int($3 / 1000); exit}' "$cuda/cuda_runtime_api.h")
pylib=$("$python" -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
pyver=$("$python" -c "import sysconfig; print(sysconfig.get_config_var('LDVERSION'))")
mkdir -p build/fuzz
"$clang" -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -DCDL_CUDART_HEADER_MAJOR="$cudart_major" \
  -I csrc -I include -isystem "$dlpack" -isystem "$cuda" -I "$pyinc" \
  tests/fuzz/fuzz_interface.c csrc/*.c -L "$pylib" -Wl,-rpath,"$pylib" -l"python$pyver" -ldl -lm \
  -o build/fuzz/fuzz_interface >build/fuzz/build.log 2>&1 || {
    if grep -q "clang_rt.fuzzer" build/fuzz/build.log; then
      missing "$clang has no libFuzzer runtime (libclang_rt.fuzzer; $debian)"
    fi
    cat build/fuzz/build.log; exit 1; }
mkdir -p build/fuzz/corpus
export ASAN_OPTIONS=detect_leaks=0
exec build/fuzz/fuzz_interface -artifact_prefix=build/fuzz/ -max_total_time="$seconds" -print_final_stats=1 build/fuzz/corpus tests/fuzz/corpus
