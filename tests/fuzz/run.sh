#!/usr/bin/env bash
# Builds a libFuzzer target (clang with -fsanitize=fuzzer,address,undefined; Debian: clang-14 and
# libclang-rt-14-dev) and runs it on its corpus: fuzz_interface.c on tests/fuzz/corpus, fuzz_doors.c on
# tests/fuzz/corpus_doors (with the CUDA runtime double for its device allocations).
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
clang=$(command -v clang || command -v clang-14)
python=${PYTHON:-python3}
dlpack=$("$python" -c "import tvm_ffi.libinfo as l; print(l.find_dlpack_include_path())")
cuda=$("$python" -c "import nvidia, os; print([os.path.join(p, 'cu13', 'include') for p in nvidia.__path__ if os.path.exists(os.path.join(p, 'cu13', 'include'))][0])")
pyinc=$("$python" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
pylib=$("$python" -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
pyver=$("$python" -c "import sysconfig; print(sysconfig.get_config_var('LDVERSION'))")
mkdir -p build/fuzz "build/fuzz/corpus_$target"
"$clang" -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -DCDL_CUDART_HEADER_MAJOR=13 \
  -I csrc -I include -isystem "$dlpack" -isystem "$cuda" -I "$pyinc" \
  "tests/fuzz/fuzz_$target.c" csrc/*.c -L "$pylib" -Wl,-rpath,"$pylib" -l"python$pyver" -ldl -lm \
  -o "build/fuzz/fuzz_$target"
# The runtime double answers for CUDA memory (the allocator's device, pinned and managed tensors).
cc -shared -fPIC -O1 -pthread tests/cudart_double/cudart_double.c -o build/fuzz/libcudart_double.so
export CAI_DLPACK_CUDART=$PWD/build/fuzz/libcudart_double.so
# Huge allocations come back NULL (refused by the allocator) rather than stopping the run.
export ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:max_allocation_size_mb=2048
exec "build/fuzz/fuzz_$target" -artifact_prefix=build/fuzz/ -max_total_time="$seconds" -print_final_stats=1 \
  -malloc_limit_mb=4096 -rss_limit_mb=6144 "build/fuzz/corpus_$target" "$corpus"
