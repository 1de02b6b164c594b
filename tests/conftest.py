"""Shared by every suite: makes tests/support importable. The CPU suite (tests/cpu) runs against the CUDA
runtime test double; the GPU suite (tests/gpu) against the real runtime."""
import os
import sys
import sysconfig


def pytest_sessionstart(session):
    """A run that names the build it means to test (tests/run_sanitized.sh sets CAI_DLPACK_EXPECTED_BUILD to its
    package folder) proves it loaded that build, an ASan and UBSan one, before any test runs; an editable
    install's import hook, for one, wins over PYTHONPATH and would load the plain module instead."""
    expected = os.environ.get("CAI_DLPACK_EXPECTED_BUILD")
    if not expected:
        return
    import pytest
    import cai_dlpack._core

    loaded = os.path.realpath(cai_dlpack._core.__file__)
    if os.path.dirname(loaded) != os.path.realpath(expected):
        pytest.exit(f"this run imported cai_dlpack._core from {loaded}, not from the build under test in {expected} "
                    "(an editable install's import hook wins over PYTHONPATH: uninstall it, or use another "
                    "environment)", returncode=1)
    with open(loaded, "rb") as module:
        image = module.read()
    lacking = [name for name, symbol in (("AddressSanitizer", b"__asan_init"), ("UBSan", b"__ubsan_handle_"))
               if symbol not in image]
    if lacking:
        pytest.exit(f"cai_dlpack._core at {loaded} is not built with {' and '.join(lacking)}", returncode=1)


def pytest_addoption(parser):
    # Here, not in tests/cpu/conftest.py: pytest reads options only from the conftest files of the folders it is
    # started on (the README's `python3 -m pytest` starts on tests/).
    parser.addoption("--late-double", action="store_true",
                     help="run every CPU test with the CUDA runtime double in late mode: streams run only when forced")


def pytest_sessionfinish(session, exitstatus):
    """On a free-threaded CPython the GIL must still be off when the run ends: one module imported on the way
    (ours, a test extension, a test dependency) that does not declare Py_mod_gil turns it on for the whole
    process, and every later free-threading test then proves nothing. The run fails if so."""
    if not sysconfig.get_config_var("Py_GIL_DISABLED") or not sys._is_gil_enabled():
        return
    forced = " (PYTHON_GIL=1 is set)" if os.environ.get("PYTHON_GIL") == "1" else ""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"FAILED: the GIL was turned on during this free-threaded run{forced}", red=True)
    session.exitstatus = 1


def pytest_collection_finish(session):
    """What the imports and the collection made (torch's, NumPy's, Hypothesis' objects, the parameters) lives to
    the end of the run: frozen out of the collector's reach, so that the collections tests ask for (the cudart
    fixture's, the leak checks') walk only what the tests themselves made. Objects made later, cycles included,
    are collected as before."""
    import gc

    gc.freeze()
