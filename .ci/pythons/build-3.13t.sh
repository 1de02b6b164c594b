#!/usr/bin/env bash
# Builds a free-threaded CPython 3.13 (configure --disable-gil) from the python3.13 source package of
# Debian's trixie suite, checked against the archive's signed index, into a cache outside the clone.
# A rerun finds the built interpreter and does nothing. Prints the interpreter's path last.
#   CAI_DLPACK_CACHE  cache folder (default ~/.cache/cai-dlpack)
#   DEBIAN_MIRROR     archive to read (default: the first deb.debian.org-style URI in this machine's apt sources)
# With the argument --tsan it builds the same interpreter with clang and ThreadSanitizer
# (--with-thread-sanitizer) into python3.13t-tsan instead (tests/run_tsan.sh uses it).
set -euo pipefail
cache=${CAI_DLPACK_CACHE:-$HOME/.cache/cai-dlpack}
variant=python3.13t
configure_extra=()
compiler=gcc
if [ "${1:-}" = --tsan ]; then
  variant=python3.13t-tsan
  configure_extra=(--with-thread-sanitizer CC=clang CXX=clang++)
  compiler=clang
fi
prefix=$cache/$variant
python=$prefix/bin/python3.13t
if [ -x "$python" ] && "$python" -c "import sys, venv; assert not sys._is_gil_enabled()" 2>/dev/null; then
  echo "$python"; exit 0
fi
for tool in apt-get make $compiler; do
  command -v "$tool" >/dev/null || { echo "build-3.13t: '$tool' is missing (Debian: apt-get install build-essential $compiler)" >&2; exit 1; }
done
mirror=${DEBIAN_MIRROR:-$(grep -h -o -E 'https?://[^ ]*/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null | head -n 1 | tr -d ' ' || true)}
mirror=${mirror:-http://deb.debian.org/debian}
work=$cache/src-$variant
rm -rf "$work"; mkdir -p "$work/lists/partial"
echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" >"$work/sources.list"
# A private apt configuration: the machine's own sources and lists are left as they are.
apt_private=(-o Dir::Etc::SourceList="$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
             -o Dir::State::Lists="$work/lists" -o APT::Sandbox::User=root)
apt-get -q "${apt_private[@]}" update >&2
(cd "$work" && apt-get -q "${apt_private[@]}" source --download-only python3.13 >&2)
tarball=$(ls "$work"/python3.13_*.orig.tar.* | head -n 1)
mkdir "$work/src"
tar -xf "$tarball" -C "$work/src" --strip-components=1
cd "$work/src"
# Modules whose libraries this machine lacks are left out by configure; the test suite needs none of them.
nice ./configure -q --disable-gil --prefix="$prefix" --without-ensurepip "${configure_extra[@]}" >&2
nice make -s -j"$(nproc)" >&2
make -s altinstall >&2
"$python" -m ensurepip >&2 || true
rm -rf "$work"
"$python" -c "import sys; assert not sys._is_gil_enabled(), 'GIL enabled'"
echo "$python"
