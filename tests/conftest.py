"""Shared by every suite: makes tests/support importable. The CPU suite (tests/cpu) runs against the CUDA
runtime test double; the GPU suite (tests/gpu) against the real runtime."""
import os
import sys
import sysconfig


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
