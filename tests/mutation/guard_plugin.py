"""A pytest plugin the mutation run (run.py) loads into every test run: it stops the run before any test
unless the imported cai_dlpack._core is the module just built (its path and SHA-256 named by run.py), so no
result is ever read from another build of the module."""
import hashlib
import os
import sys

import pytest

GUARD_FAILED = 97


def pytest_collection_finish(session):
    expected_path = os.environ.get("CDL_MUTANT_MODULE")
    expected_hash = os.environ.get("CDL_MUTANT_SHA256")
    if not expected_path or not expected_hash:
        pytest.exit("guard_plugin: run.py names no module (CDL_MUTANT_MODULE, CDL_MUTANT_SHA256)", GUARD_FAILED)
    import cai_dlpack._core as core

    loaded = os.path.realpath(core.__file__)
    with open("/proc/self/maps") as maps:
        mapped = sorted({line.split()[-1] for line in maps if "cai_dlpack/_core" in line})
    with open(loaded, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if loaded != os.path.realpath(expected_path) or digest != expected_hash or \
            {os.path.realpath(m) for m in mapped} != {loaded}:
        pytest.exit(f"guard_plugin: imported {loaded} (sha256 {digest[:12]}, mapped {mapped}), expected "
                    f"{expected_path} ({expected_hash[:12]}); sys.path[0:3]={sys.path[:3]}", GUARD_FAILED)
