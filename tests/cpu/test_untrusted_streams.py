"""A stream a consumer names by handle may be destroyed once the call returns (CuPy's and Numba's stream objects
destroy theirs when collected), and any runtime call on a destroyed handle may crash the process (seen on an H200:
a query, a record, even cudaStreamGetId). So by default nothing made for a handle uses it at the drop: the release
is made at once, as before ordered release, and a device copy's memory goes back by cudaFree. The legacy and
per-thread streams never go, and stay ordered; options(trust_streams=True) (or CAI_DLPACK_TRUST_STREAMS=1) says the
caller's handles outlive what is made for them, and orders after them too (test_ordered_release.py)."""
import gc
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest

import cai_dlpack
from cai_dlpack import DLPackShim, _core
from support.cai_objects import CaiArray, register
from support.cuda_double import DEVICE
from test_ordered_release import (DOORS, N, NEXT, ORIGINAL, S1, S2, Pool, consume,
                                  copy_keeps_its_source_until_it_ran, drain, kernel_after_drop, read)

HANDLE_DOORS = ["DLPackShim", "cai2dlpack", "DLPackView", "C API"]


@pytest.fixture
def untrusted(monkeypatch):
    """The default, whatever the environment the suite runs in says."""
    monkeypatch.delenv("CAI_DLPACK_TRUST_STREAMS", raising=False)
    before = cai_dlpack.options()["trust_streams"]
    cai_dlpack.options(trust_streams=False)
    yield
    cai_dlpack.options(trust_streams=before)


@pytest.fixture
def late(cudart, untrusted):
    cudart.add_stream(S1, 0)
    cudart.add_stream(S2, 0)
    cudart.late = True
    yield cudart
    drain(cudart)
    cudart.late = False


def naming(log, stream):
    return [line for line in log if f"{stream})" in line or f"{stream}," in line]


@pytest.mark.parametrize("door", HANDLE_DOORS)
def test_a_handle_is_not_used_at_the_drop(late, door):
    pool = Pool(late)
    x = pool.take(ORIGINAL)
    watch = weakref.ref(x)
    data, drop, stream = DOORS[door](x)
    assert stream == S2
    late.launch_kernel(S2, lambda: None)
    del x
    late.clear_log()
    drop()
    gc.collect()
    assert watch() is None  # released at once: nothing waits on a stream that may be gone
    assert naming(late.log(), S2) == [], late.log()
    assert _core._pending_releases()["pending"] == 0


@pytest.mark.parametrize("door", HANDLE_DOORS)
def test_without_trust_a_kernel_queued_before_the_drop_can_read_reused_memory(late, door):
    """The price of the default, shown: the issue's scenario on an untrusted handle reads the next allocation."""
    seen, watch, waits = kernel_after_drop(late, door)
    np.testing.assert_array_equal(seen, NEXT)
    assert watch() is None


@pytest.mark.parametrize("door", ["cai2dlpack without keywords", "exchange API"])
def test_the_legacy_stream_is_ordered_without_trust(late, door):
    seen, watch, waits = kernel_after_drop(late, door)
    np.testing.assert_array_equal(seen, ORIGINAL)
    assert waits == 0


def test_trusted_handles_are_ordered(late):
    cai_dlpack.options(trust_streams=True)
    try:
        seen, watch, waits = kernel_after_drop(late, "DLPackShim")
    finally:
        cai_dlpack.options(trust_streams=False)
    np.testing.assert_array_equal(seen, ORIGINAL)


def test_a_device_copy_for_a_handle_is_freed_by_cudafree_at_the_drop(late):
    """The copy's memory cannot go back in the order of a stream that may be gone: cudaFree, which waits for the
    device, so a kernel queued before the drop still reads the copy."""
    pool = Pool(late)
    x = pool.take(ORIGINAL)
    copy, drop = consume(DLPackShim(x).__dlpack__(stream=S2, copy=True, max_version=(1, 0)))
    seen = []
    late.launch_kernel(S2, lambda: seen.append(read(copy)))
    late.clear_log()
    drop()
    assert "cudaFree()" in late.log() and naming(late.log(), S2) == [], late.log()
    np.testing.assert_array_equal(seen[0], ORIGINAL)  # cudaFree ran the device first


def test_the_option_is_taken_when_the_tensor_is_made(late):
    """What was made while trusted stays ordered after its handle when trust is switched off before the drop."""
    cai_dlpack.options(trust_streams=True)
    try:
        pool = Pool(late)
        x = pool.take(ORIGINAL)
        watch = weakref.ref(x)
        data, drop, _ = DOORS["DLPackShim"](x)
        del x
    finally:
        cai_dlpack.options(trust_streams=False)
    late.launch_kernel(S2, lambda: None)
    drop()
    gc.collect()
    assert watch() is not None and _core._pending_releases()["pending"] == 1
    drain(late)
    assert watch() is None


@pytest.mark.parametrize("value", [1, "yes", 0.0])
def test_trust_streams_takes_only_a_bool(untrusted, value):
    """A TypeError naming the key, the value and its type; and no setting changes, the valid ones named with it
    neither (nothing half-done)."""
    before = cai_dlpack.options()
    with pytest.raises(TypeError) as raised:
        cai_dlpack.options(trust_streams=value, sync=False)
    assert str(raised.value) == f"options(trust_streams={value!r}) must be a bool, not {type(value).__name__}"
    assert cai_dlpack.options() == before


def test_an_option_not_named_or_given_none_is_left_as_it_is(untrusted):
    before = cai_dlpack.options()
    try:
        away = {"sync": False, "export_stream": False, "trust_streams": True}  # each away from its default
        assert cai_dlpack.options(**away) == away
        assert cai_dlpack.options(sync=None, export_stream=None, trust_streams=None) == away
        assert cai_dlpack.options(export_stream=False) == away
        assert cai_dlpack.options(sync=True) == dict(away, sync=True)
    finally:
        cai_dlpack.options(**before)


def test_a_refused_value_whose_repr_fails_is_still_refused_by_name(untrusted):
    class Unshowable:
        def __repr__(self):
            raise ValueError("no repr")

    with pytest.raises(TypeError, match=r"^options\(trust_streams=\.\.\.\) must be a bool, not Unshowable$"):
        cai_dlpack.options(trust_streams=Unshowable())
    assert cai_dlpack.options()["trust_streams"] is False


def test_trust_streams_from_the_environment_only_in_so_many_words():
    """A promise about the caller's streams is made only by 1, true, yes or on (any case): a typo or an unknown
    word leaves it off, where the opt-outs' variables take any word but the off ones as on."""
    code = "import cai_dlpack; print(cai_dlpack.options()['trust_streams'])"
    words = {"1": True, "true": True, "TRUE": True, "Yes": True, "on": True, "ON": True, None: False, "": False,
             "0": False, "off": False, "FALSE": False, "No": False, "n": False, "anything": False, " 1": False,
             "2": False}
    seen = {}
    for word in words:
        env = {k: v for k, v in os.environ.items() if k != "CAI_DLPACK_TRUST_STREAMS"}
        if word is not None:
            env["CAI_DLPACK_TRUST_STREAMS"] = word
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        seen[word] = result.stdout.strip() == "True"
    assert seen == words


def test_a_device_copy_for_a_handle_keeps_its_source_until_the_copy_ran(late):
    """The copy is queued on the handle's stream during the call, while the stream is surely there: its source is
    kept until the copy ran, trusted or not."""
    copy_keeps_its_source_until_it_ran(late)


def test_a_trusted_copy_for_stream_minus_one_is_not_freed_on_the_producers_stream(late):
    """stream=-1 copies on the producer's stream; the promise covers the streams consumers name, not the producer's
    (which may go with the producer), so the copy's memory goes back by cudaFree at the drop."""
    pool = Pool(late)
    x = pool.take(ORIGINAL)
    cai_dlpack.options(trust_streams=True)
    try:
        copy, drop = consume(DLPackShim(x).__dlpack__(stream=-1, copy=True, max_version=(1, 0)))
    finally:
        cai_dlpack.options(trust_streams=False)
    del x
    late.run_all()
    late.clear_log()
    drop()
    assert "cudaFree()" in late.log() and naming(late.log(), S1) == [], late.log()


def test_a_failed_cudafree_of_a_copy_leaves_no_runtime_error_behind(late):
    """The drop's cudaFree has nobody to report to: its error is cleared, not left for the next framework."""
    pool = Pool(late)
    x = pool.take(ORIGINAL)
    copy, drop = consume(DLPackShim(x).__dlpack__(stream=S2, copy=True, max_version=(1, 0)))
    late.run_all()
    late.clear_log()
    late.fail("cudaFree", 700)
    drop()
    assert "cudaFree()" in late.log() and late.last_error == 0 and late.context_device == 0, late.log()


def test_a_copy_for_minus_one_made_on_the_producers_per_thread_stream_goes_back_in_its_order(late):
    """The per-thread stream never goes: a copy for stream=-1, made on the producer's per-thread stream, is freed
    by cudaFreeAsync there at the drop, no promise needed."""
    block = np.arange(N, dtype=np.float32)
    register(late, block, DEVICE)
    copy, drop = consume(DLPackShim(CaiArray(block, stream=2)).__dlpack__(stream=-1, copy=True, max_version=(1, 0)))
    late.run_all()
    late.clear_log()
    drop()
    assert "cudaFreeAsync(2)" in late.log() and "cudaFree()" not in late.log(), late.log()
