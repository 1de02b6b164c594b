#!/usr/bin/env bash
# Builds the libFuzzer target (clang with -fsanitize=fuzzer,address,undefined; Debian: clang-14 and
# libclang-rt-14-dev) and runs it on tests/fuzz/corpus. Usage: bash tests/fuzz/run.sh [seconds]
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-60}
clang=$(command -v clang || command -v clang-14)
python=${PYTHON:-python3}
dlpack=$("$python" -c "import tvm_ffi.libinfo as l; print(l.find_dlpack_include_path())")
cuda=$("$python" -c "import nvidia, os; print([os.path.join(p, 'cu13', 'include') for p in nvidia.__path__ if os.path.exists(os.path.join(p, 'cu13', 'include'))][0])")
pyinc=$("$python" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
pylib=$("$python" -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
pyver=$("$python" -c "import sysconfig; print(sysconfig.get_config_var('LDVERSION'))")
mkdir -p build/fuzz
"$clang" -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -DCDL_CUDART_HEADER_MAJOR=13 \
  -I csrc -I include -isystem "$dlpack" -isystem "$cuda" -I "$pyinc" \
  tests/fuzz/fuzz_interface.c csrc/*.c -L "$pylib" -Wl,-rpath,"$pylib" -l"python$pyver" -ldl -lm \
  -o build/fuzz/fuzz_interface
mkdir -p build/fuzz/corpus
export ASAN_OPTIONS=detect_leaks=0
exec build/fuzz/fuzz_interface -artifact_prefix=build/fuzz/ -max_total_time="$seconds" -print_final_stats=1 build/fuzz/corpus tests/fuzz/corpus
