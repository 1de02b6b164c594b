# Sourced by the hardening scripts (tests/run_sanitized.sh, tests/fuzz/run.sh) once they are in the
# repository root with $python set. The build requirements of pyproject.toml (nvidia-cuda-runtime and
# nvidia-cuda-crt for the CUDA Runtime API headers; the DLPack ABI is our own header) come from the folder named by
# BUILD_DEPS (pip install --target DIR ...), else from $python when it has them, else they are installed
# once into build/build-deps-<python version>/, which git ignores.

# Says in one line what is missing and how to get it, and stops the script.
missing() {
  echo "$0: $*" >&2
  exit 1
}

# Whether $python, with folder $1 (or nothing) first on its path, finds what CMakeLists.txt looks for.
has_build_requirements() {
  PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}" "$python" -c "
import os, nvidia
assert any(os.path.exists(os.path.join(p, s, 'include', 'crt', 'host_defines.h'))
           for p in nvidia.__path__ for s in ('cu13', 'cuda_runtime'))" 2>/dev/null
}

# Sets build_deps: the folder to put first on PYTHONPATH for the build (empty when $python has all).
# With the argument cmake, a machine without cmake gets the cmake wheel too, and cmake_binary is set.
find_build_requirements() {
  cmake_binary=$(command -v cmake || true)
  local want_cmake=""
  [ "${1:-}" = cmake ] && [ -z "$cmake_binary" ] && want_cmake=cmake
  build_deps=${BUILD_DEPS:-}
  if [ -n "$build_deps" ] || { [ -z "$want_cmake" ] && has_build_requirements ""; }; then
    return 0
  fi
  build_deps="$PWD/build/build-deps-$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  local needed=(nvidia-cuda-runtime nvidia-cuda-crt $want_cmake)
  if ! has_build_requirements "$build_deps" ||
     { [ -n "$want_cmake" ] && [ ! -x "$build_deps/cmake/data/bin/cmake" ]; }; then
    echo "$0: installing the build requirements (${needed[*]}) into $build_deps"
    mkdir -p build
    "$python" -m pip install -q --target "$build_deps" --upgrade "${needed[@]}" >"$build_deps.log" 2>&1 ||
      missing "could not install ${needed[*]} (see $build_deps.log); install them with" \
        "'$python -m pip install --target DIR ${needed[*]}', then run again with BUILD_DEPS=DIR"
  fi
  [ -z "$want_cmake" ] || cmake_binary="$build_deps/cmake/data/bin/cmake"
}
