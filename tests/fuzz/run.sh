#!/usr/bin/env bash
# Builds a libFuzzer target (clang with -fsanitize=fuzzer,address,undefined; Debian: clang-14 and
# libclang-rt-14-dev) and runs it on its corpus: fuzz_interface.c (the parser and the view) on
# tests/fuzz/corpus, fuzz_doors.c (the C API and the exchange API) on tests/fuzz/corpus_doors, with the CUDA
# runtime double answering for device memory. The build requirements come from BUILD_DEPS, the current python
# or a cache it fills once (tests/support/build_requirements.sh says which).
# Usage: bash tests/fuzz/run.sh [seconds] [interface|doors]
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-60}
target=${2:-interface}
case "$target" in
  interface) corpus=tests/fuzz/corpus ;;
  doors) corpus=tests/fuzz/corpus_doors ;;
  *) echo "unknown target $target (interface or doors)" >&2; exit 2 ;;
esac
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
cuda=$(run_python "import nvidia, os
print(next(d for p in nvidia.__path__ for d in (os.path.join(p, s, 'include') for s in ('cu13', 'cuda_runtime'))
           if os.path.exists(os.path.join(d, 'cuda_runtime_api.h'))))")
cudart_major=$(awk '/^#define CUDART_VERSION/ {print int($3 / 1000); exit}' "$cuda/cuda_runtime_api.h")
pylib=$("$python" -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
pyver=$("$python" -c "import sysconfig; print(sysconfig.get_config_var('LDVERSION'))")
mkdir -p build/fuzz "build/fuzz/corpus_$target"
"$clang" -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -DCDL_CUDART_HEADER_MAJOR="$cudart_major" \
  -I csrc -I include -isystem "$cuda" -I "$pyinc" \
  "tests/fuzz/fuzz_$target.c" csrc/*.c -L "$pylib" -Wl,-rpath,"$pylib" -l"python$pyver" -ldl -lm \
  -o "build/fuzz/fuzz_$target" >build/fuzz/build.log 2>&1 || {
    if grep -q "clang_rt.fuzzer" build/fuzz/build.log; then
      missing "$clang has no libFuzzer runtime (libclang_rt.fuzzer; $debian)"
    fi
    cat build/fuzz/build.log; exit 1; }
"$clang" -shared -fPIC -O1 -pthread tests/cudart_double/cudart_double.c -o build/fuzz/libcudart_double.so -ldl
export CAI_DLPACK_CUDART=$PWD/build/fuzz/libcudart_double.so
# A huge allocation comes back NULL (which the allocator must refuse) rather than stopping the run.
export ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:max_allocation_size_mb=2048
exec "build/fuzz/fuzz_$target" -artifact_prefix=build/fuzz/ -max_total_time="$seconds" -print_final_stats=1 \
  -malloc_limit_mb=4096 -rss_limit_mb=6144 "build/fuzz/corpus_$target" "$corpus"
