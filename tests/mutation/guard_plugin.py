"""A pytest plugin the mutation run (run.py) loads into every test run: it stops the run before any test
unless the imported cai_dlpack._core is the module just built (its path and SHA-256 named by run.py), so no
result is ever read from another build of the module. A test's Python child imports what its PYTHONPATH finds:
a child started with an environment whose PYTHONPATH lacks the module's folder would import another build (the
one installed in the environment), so such a start fails the test instead."""
import hashlib
import os
import subprocess
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


def _python_child_without_the_build(command, env, package_root):
    """The reason a child would import another build of cai_dlpack, or None."""
    if env is None:
        return None  # it inherits this process's PYTHONPATH
    words = [command] if isinstance(command, (str, bytes, os.PathLike)) else list(command)
    pythons = {sys.executable, os.path.realpath(sys.executable)}
    if not any(os.fsdecode(word) in pythons or os.path.realpath(os.fsdecode(word)) in pythons for word in words):
        return None
    paths = [os.path.realpath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if os.path.realpath(package_root) in paths:
        return None
    return (f"guard_plugin: this test starts a Python child ({' '.join(map(os.fsdecode, words))[:200]}) whose "
            f"PYTHONPATH ({env.get('PYTHONPATH')!r}) lacks {package_root}: it would import another build of "
            "cai_dlpack than the one under test. Put the test's folder before the inherited PYTHONPATH instead of "
            "replacing it.")


def pytest_configure(config):
    expected_path = os.environ.get("CDL_MUTANT_MODULE")
    if not expected_path:
        return
    package_root = os.path.dirname(os.path.dirname(expected_path))
    start = subprocess.Popen.__init__

    def checked_start(self, args, *positional, **keywords):
        env = keywords.get("env", positional[9] if len(positional) > 9 else None)
        why = _python_child_without_the_build(args, env, package_root)
        if why is not None:
            self._child_created = False  # what Popen.__del__ reads of an instance that never started
            raise RuntimeError(why)
        start(self, args, *positional, **keywords)

    subprocess.Popen.__init__ = checked_start
