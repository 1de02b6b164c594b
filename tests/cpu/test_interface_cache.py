"""The record read from a ready interface dict is kept and reused while the dict is unchanged (its version tag,
which the change itself writes; no records from 3.14, where dicts have none): every change to the dict, and every value that could change without the dict
changing, must still be read afresh. _interface_cache_info() counts reuses ("hits") and records kept
("stores"), so each test can say which way a conversion went."""
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cai_dlpack import DLPackShim, _core, cai2dlpack, dlpack2cai
from support.cai_objects import CaiArray, register
from support.cuda_double import DEVICE, PINNED_HOST

S1, S2 = 0x5000, 0x6000

kept_only = pytest.mark.skipif(
    not _core._interface_cache_info()["enabled"],
    reason="no records are kept here (CPython 3.14 and later: a dict has no version tag there)")


class Holder:
    pass


def holding(iface):
    made = Holder()
    made.__array_interface__ = iface
    return made


def counts():
    info = _core._interface_cache_info()
    return info["hits"], info["stores"]


def converted(obj, **kwargs):
    """(hits, stores) the conversion of obj added, and the array it gave."""
    hits, stores = counts()
    array = np.asarray(dlpack2cai(cai2dlpack(obj, **kwargs)))
    after = counts()
    return (after[0] - hits, after[1] - stores), array


@kept_only
def test_an_unchanged_ready_dict_is_read_once_then_reused():
    x = np.arange(12.0).reshape(3, 4)
    made = holding(dict(x.__array_interface__))
    assert converted(made)[0] == (0, 1)
    for _ in range(3):
        took, array = converted(made)
        assert took == (1, 0)
        np.testing.assert_array_equal(array, x)
        assert array.__array_interface__["data"][0] == x.ctypes.data


@kept_only
def test_a_ready_dict_subclass_is_read_by_the_general_reader_once_then_reused():
    """A dict subclass is never the fused reader's (its methods may be overridden), but its record is kept and
    reused like an exact dict's."""

    class Interface(dict):
        pass

    x = np.arange(12.0).reshape(3, 4)
    made = holding(Interface(x.__array_interface__))
    fused = _core._fused_reads()
    assert converted(made)[0] == (0, 1)
    for _ in range(3):
        took, array = converted(made)
        assert took == (1, 0)
        np.testing.assert_array_equal(array, x)
    assert _core._fused_reads() == fused


@kept_only
def test_the_shim_and_the_c_api_path_reuse_it_too():
    x = np.arange(6, dtype=np.int16)
    made = holding(dict(x.__array_interface__))
    cai2dlpack(made)
    hits = counts()[0]
    np.testing.assert_array_equal(np.from_dlpack(DLPackShim(made)), x)
    assert counts()[0] == hits + 1


def _retyped(iface, x):
    iface["typestr"] = "<i8"
    return x.view(np.int64)


def _reshaped(iface, x):
    iface["shape"] = (4, 3)
    return x.reshape(4, 3)


def _restrided(iface, x):
    iface["strides"] = (8, 32)
    iface["shape"] = (4, 3)
    return x.reshape(3, 4).T


def _moved(iface, x):
    iface["data"] = (x.ctypes.data + 8, False)
    iface["shape"] = (11,)
    return x.reshape(-1)[1:]


def _cleared_and_refilled(iface, x):
    fresh = dict(x[1:].__array_interface__)
    iface.clear()
    iface.update(fresh)
    return x[1:]


def _key_replaced_by_equal_one(iface, x):
    del iface["shape"]
    iface["shape"] = (2, 6)
    return x.reshape(2, 6)


@pytest.mark.parametrize("change", [_retyped, _reshaped, _restrided, _moved, _cleared_and_refilled,
                                    _key_replaced_by_equal_one])
@kept_only
def test_a_changed_dict_is_read_afresh(change):
    x = np.arange(12.0).reshape(3, 4)
    iface = dict(x.__array_interface__)
    made = holding(iface)
    converted(made)
    converted(made)
    expected = change(iface, x)
    took, array = converted(made)
    assert took[0] == 0
    assert array.shape == expected.shape and array.dtype == expected.dtype
    assert array.__array_interface__["data"][0] == expected.__array_interface__["data"][0]
    np.testing.assert_array_equal(array, expected)


@pytest.mark.parametrize("key, value, error, match", [
    ("mask", np.zeros(3, dtype=bool), BufferError, "'mask' is set"),
    ("shape", [3, -4], ValueError, r"'shape'\[1\] is -4"),
    ("typestr", "<i3", BufferError, "typestr"),
    ("version", "3", TypeError, "'version' must be an int"),
    ("data", (0, False), ValueError, "pointer is 0"),
])
@kept_only
def test_a_dict_made_invalid_after_a_reuse_is_refused(key, value, error, match):
    x = np.arange(12.0).reshape(3, 4)
    iface = dict(x.__array_interface__)
    made = holding(iface)
    converted(made)
    converted(made)
    iface[key] = value
    with pytest.raises(error, match=match):
        cai2dlpack(made)
    with pytest.raises(error, match=match):
        cai2dlpack(made)
    iface.update(x.__array_interface__)
    iface.pop("mask", None)
    np.testing.assert_array_equal(converted(made)[1], x)


@kept_only
def test_a_removed_required_key_is_refused_after_a_reuse():
    x = np.arange(3.0)
    iface = dict(x.__array_interface__)
    made = holding(iface)
    converted(made)
    converted(made)
    del iface["typestr"]
    with pytest.raises(ValueError, match="lacks the required key 'typestr'"):
        cai2dlpack(made)


@kept_only
@pytest.mark.parametrize("strides", [None, [8]], ids=["no strides", "a strides list"])
def test_lists_changed_in_place_are_seen(strides):
    """A list can change without its dict changing: a dict holding one is never kept."""
    x = np.arange(12.0)
    iface = dict(x.__array_interface__, shape=[12], strides=strides)
    made = holding(iface)
    assert converted(made)[0] == (0, 0)
    iface["shape"][0] = 6
    if strides:
        iface["strides"][0] = 16
    took, array = converted(made)
    assert took == (0, 0)
    np.testing.assert_array_equal(array, x[::2] if strides else x[:6])


@kept_only
@pytest.mark.parametrize("asked", [{}, {"max_version": (1, 0)}], ids=["no keywords", "keywords"])
@pytest.mark.parametrize("keys", ["NumPy's", "typestr only", "a key of its own"])
def test_a_property_that_builds_its_dict_each_time_is_never_kept(keys, asked):
    """A dict only the conversion holds is about to go: never kept, whether or not its type is named by a descr
    (which alone keeps a dict out), read by the fused reader or (a key it does not know) by the general one."""
    x = np.arange(5.0)

    class Fresh:
        @property
        def __array_interface__(self):
            made = dict(x.__array_interface__)
            if keys != "NumPy's":
                del made["descr"]
            if keys == "a key of its own":
                made["producer"] = "ours"
            return made

    for _ in range(3):
        assert converted(Fresh(), **asked)[0] == (0, 0)


@kept_only
def test_a_type_named_by_the_descr_is_read_each_time():
    """bfloat16 is not in a typestr; the name in the descr list (which can change in place) decides it."""
    x = np.arange(4, dtype=np.uint16)
    iface = dict(x.__array_interface__, typestr="<V2", descr=[("bfloat16", "<V2")])
    made = holding(iface)
    assert dlpack2cai(cai2dlpack(made)).__array_interface__["descr"] == [("bfloat16", "<V2")]
    hits, stores = counts()
    iface["descr"][0] = ("float16", "<V2")
    assert np.asarray(dlpack2cai(cai2dlpack(made))).dtype == np.float16
    assert counts() == (hits, stores)


@kept_only
def test_an_asked_dtype_neither_reuses_nor_keeps():
    x = np.arange(4, dtype=np.uint16)
    made = holding(dict(x.__array_interface__))
    converted(made)
    hits, stores = counts()
    assert np.asarray(dlpack2cai(cai2dlpack(made, dtype="float16"))).dtype == np.float16
    assert counts() == (hits, stores)
    took, array = converted(made)
    assert took == (1, 0) and array.dtype == np.uint16


@kept_only
def test_dicts_that_take_each_others_place_are_each_read():
    """A freed dict's address is soon another dict's (pymalloc hands the last freed block out first): each
    conversion must describe its own dict, not the record of the dict that was there before."""
    x = np.arange(64.0)
    made, addresses = Holder(), set()
    made.__array_interface__ = {}
    for n in range(1, 40):
        del made.__array_interface__
        made.__array_interface__ = {"shape": (n,), "typestr": "<f8", "data": (x.ctypes.data, False),
                                    "strides": None, "version": 3}
        addresses.add(id(made.__array_interface__))
        for _ in range(2):
            assert converted(made)[1].shape == (n,)
    if len(addresses) == 39:
        pytest.skip("this allocator gave every dict a new address (a sanitizer's quarantine does)")


@kept_only
def test_dicts_of_each_slot_are_kept_side_by_side():
    """Four records are kept, one in each slot, a dict's slot picked by bits 6 and 7 of its address
    (interface_cache.c): four ready dicts, one of each slot, read in turn, are each reused the next time round,
    none evicting another."""
    x = np.arange(8.0)
    candidates, by_slot = [], {}
    while len(by_slot) < 4:
        made = holding(dict(x.__array_interface__))
        candidates.append(made)  # held: no address is given to a later dict
        by_slot.setdefault((id(made.__array_interface__) >> 6) & 3, made)
        assert len(candidates) < 10000
    four = [by_slot[slot] for slot in range(4)]
    assert [converted(made)[0] for made in four] == [(0, 1)] * 4
    for _ in range(2):
        assert [converted(made)[0] for made in four] == [(1, 0)] * 4


@kept_only
def test_one_dict_read_as_either_interface_keeps_each_answer(cudart):
    """The same dict as a CAI (a device pointer on a producer stream) and as an array interface (which has no
    stream): the source is part of the key, so each reuse orders streams only for the CAI."""
    x = np.arange(8, dtype=np.float32)
    register(cudart, x, DEVICE)
    cudart.add_stream(S1, 0)
    iface = dict(x.__array_interface__, version=3, stream=S1)
    made = holding(iface)
    for _ in range(3):
        cudart.clear_log()
        assert dlpack2cai(cai2dlpack(made)).device == (1, 0)
        assert not any(call.startswith("cudaEventRecord") for call in cudart.log())
        assert dlpack2cai(cai2dlpack(iface, owner=x, stream=S2)).device == (2, 0)
        assert sum(call.endswith(f", {S1})") and call.startswith("cudaEventRecord") for call in cudart.log()) == 1


@kept_only
def test_a_reused_cai_record_asks_the_device_again(cudart):
    """The pointer's device is not part of the record: memory freed and mapped again may be another kind."""
    x = np.arange(8, dtype=np.float32)
    register(cudart, x, DEVICE, device=1)
    made = CaiArray(x, stream=None)
    assert dlpack2cai(cai2dlpack(made)).device == (2, 1)
    cudart.reset()
    register(cudart, x, PINNED_HOST)
    hits = counts()[0]
    assert dlpack2cai(cai2dlpack(made)).device == (3, 0)
    assert counts()[0] == hits + 1



class Attributes:
    pass


def attributes_as_interface(x):
    """A plain instance whose attributes describe x, and a holder whose interface dict is that instance's vars()."""
    a = Attributes()
    a.version, a.shape, a.typestr, a.data = 3, x.shape, x.__array_interface__["typestr"], (x.ctypes.data, False)
    return a, holding(vars(a))


def test_an_objects_own_attributes_as_the_interface_are_read_afresh():
    """vars(a) as the interface dict, changed by attribute stores (CPython keeps those in the object's inline
    values, which 3.13.0's dict watchers missed). Read right whether or not records are kept."""
    x = np.arange(12.0)
    a, made = attributes_as_interface(x)
    for shape in ((12,), (3,), (2,), (6,)):
        if shape == (2,):
            object.__setattr__(a, "shape", shape)
        else:
            a.shape = shape
        for _ in range(2):
            np.testing.assert_array_equal(converted(made)[1], x[:shape[0]])


TAKE_EVERY_WATCHER = textwrap.dedent("""
    import ctypes, json
    # Every dict watcher id of the interpreter taken before cai_dlpack is imported (callbacks that are never
    # called: they watch no dict). PyDict_AddWatcher raises RuntimeError once none is left.
    callback_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    callback = callback_type(lambda *event: 0)
    add_watcher = ctypes.pythonapi.PyDict_AddWatcher
    add_watcher.argtypes, add_watcher.restype = [callback_type], ctypes.c_int
    taken = 0
    while True:
        try:
            add_watcher(callback)
        except RuntimeError:
            break
        taken += 1
        assert taken < 1000
    import numpy as np
    from cai_dlpack import _core, cai2dlpack, dlpack2cai
    class Holder:
        pass
    holder, array = Holder(), np.arange(6.0)
    holder.__array_interface__ = dict(array.__array_interface__)
    results = [np.asarray(dlpack2cai(cai2dlpack(holder))).tolist() for _ in range(3)]
    holder.__array_interface__["shape"] = (3,)  # its new version tag: read afresh
    results.append(np.asarray(dlpack2cai(cai2dlpack(holder))).tolist())
    print(json.dumps({"taken": taken, "info": _core._interface_cache_info(), "results": results}))
""")


@kept_only
@pytest.mark.skipif(sys.version_info < (3, 12), reason="dict watchers exist from CPython 3.12 on; CI's 3.12 and "
                    "3.13 stages run this")
def test_with_every_dict_watcher_taken_records_are_still_kept_and_changes_read():
    """Records need no dict watcher (they were kept by one on 3.12+ before): with every watcher id taken before
    the import, a ready dict is still kept, reused, and read afresh once changed."""
    result = subprocess.run([sys.executable, "-c", TAKE_EVERY_WATCHER], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["taken"] > 0
    assert seen["info"] == {"enabled": True, "hits": 2, "stores": 2}
    assert seen["results"] == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]] * 3 + [[0.0, 1.0, 2.0]]


@kept_only
@pytest.mark.skipif(sys.version_info < (3, 12), reason="dict watchers exist from CPython 3.12 on")
def test_a_dict_another_watcher_watches_is_kept_and_its_changes_are_read():
    """Another dict watcher on the dict changes nothing: the record is kept and reused, and a change (reported to
    that watcher, not to us) is read afresh, by the version tag the change writes."""
    _testcapi = pytest.importorskip("_testcapi", reason="CPython's _testcapi adds the second dict watcher")
    x = np.arange(6.0)
    iface = dict(x.__array_interface__)
    made = holding(iface)
    watcher = _testcapi.add_dict_watcher(0)  # its callback records events and never fails
    try:
        _testcapi.watch_dict(watcher, iface)
        assert converted(made)[0] == (0, 1)
        took, array = converted(made)
        assert took == (1, 0)
        np.testing.assert_array_equal(array, x)
        iface["shape"] = (3,)
        took, array = converted(made)
        assert took == (0, 1)
        np.testing.assert_array_equal(array, x[:3])
        _testcapi.unwatch_dict(watcher, iface)
    finally:
        _testcapi.clear_dict_watcher(watcher)


@kept_only
def test_a_dict_over_an_objects_inline_values_is_never_kept():
    """vars(a) of a plain instance is a split table over its inline values (3.12, 3.13): an attribute stored there
    gives the dict no new version tag on 3.13, so it is read afresh each time, never kept."""
    x = np.arange(12.0)
    a, made = attributes_as_interface(x)
    if sys.version_info < (3, 12):
        pytest.skip("3.11 keeps these: every attribute store there gives the dict a new version tag")
    for shape in ((12,), (4,)):
        a.shape = shape
        took, array = converted(made)
        assert took == (0, 0)
        np.testing.assert_array_equal(array, x[:shape[0]])


class _Dropped(int):
    """An int whose release runs Python code (the probe set on the class)."""
    probe = None

    def __del__(self):
        if _Dropped.probe is not None:
            _Dropped.probe()


class _Text(str):
    pass


class _Pair(tuple):
    pass


# Each key a record comes from, holding a value whose release may run Python code (an int, str or tuple subclass).
_NOT_INERT = {
    "version": lambda iface: _Dropped(3),
    "typestr": lambda iface: _Text(iface["typestr"]),
    "data pointer": lambda iface: (_Dropped(iface["data"][0]), False),
    "data tuple": lambda iface: _Pair(iface["data"]),
    "shape item": lambda iface: (_Dropped(6),),
    "shape tuple": lambda iface: _Pair((6,)),
    "strides item": lambda iface: (_Dropped(8),),
}


@kept_only
@pytest.mark.parametrize("key", list(_NOT_INERT))
def test_a_dict_holding_a_value_whose_release_runs_code_is_never_kept(key):
    """A value whose release may run Python code, in any key the record comes from, keeps its dict from being
    kept: on 3.11 and 3.12 that code can run inside an attribute store after the value changed and before the
    dict's new tag is written."""
    x = np.arange(6.0)
    iface = dict(x.__array_interface__)
    name = key.split()[0]
    iface[name] = _NOT_INERT[key](iface)
    made = holding(iface)
    for _ in range(2):
        took, array = converted(made)
        assert took == (0, 0)
        np.testing.assert_array_equal(array, x)


@kept_only
def test_a_cai_stream_whose_release_runs_code_is_never_kept(cudart):
    """The CAI stream is part of the record too: an int subclass there keeps the dict from being kept."""
    x = np.arange(8, dtype=np.float32)
    register(cudart, x, DEVICE)
    iface = dict(CaiArray(x, stream=None).__cuda_array_interface__)
    iface["stream"] = _Dropped(S1)

    class Held:
        __cuda_array_interface__ = iface

    for _ in range(2):
        hits, stores = counts()
        assert dlpack2cai(cai2dlpack(Held(), stream=-1)).device == (2, 0)
        assert counts() == (hits, stores)


@kept_only
def test_a_conversion_run_by_the_release_of_an_attributes_old_value_reads_the_new_one():
    """The interface is an object's own combined __dict__, changed by attribute stores (3.11 and 3.12 specialize
    them: the new value is stored, the old one released, and only then the new version tag written). A conversion
    run by the old value's release must see the new value, never the record kept of the old one (the review: 16
    of 19 stale on 3.11, 18 of 19 on 3.12)."""
    buffer = np.zeros(64, dtype=np.float32)

    class Own:
        @property
        def __array_interface__(self):
            return self.__dict__

    own = Own()
    own.__dict__ = {"version": 3, "typestr": "<f4", "data": (buffer.ctypes.data, False), "shape": (_Dropped(1),)}
    seen = []

    def shape_now():
        return np.asarray(dlpack2cai(cai2dlpack(own))).shape

    try:
        for n in range(2, 40):
            shape_now()
            shape_now()
            _Dropped.probe = lambda: seen.append((tuple(int(v) for v in own.__dict__["shape"]), shape_now()))
            own.shape = (n,) if n % 2 else (_Dropped(n),)
            _Dropped.probe = None
    finally:
        _Dropped.probe = None
    assert len(seen) >= 10
    assert [(said, got) for said, got in seen if said != got] == []


@kept_only
def test_the_test_hook_turns_keeping_off_and_on_and_raises_what_truth_raises():
    """_set_interface_cache (the tests' switch) takes any object's truth: off keeps nothing and reuses nothing,
    on keeps again, and an object whose truth raises leaves the setting as it was, with its own error."""
    host = np.arange(4, dtype=np.float32)
    iface = dict(host.__array_interface__)
    try:
        assert _core._set_interface_cache(0)["enabled"] is False
        assert converted(holding(iface))[0] == (0, 0)
        assert converted(holding(iface))[0] == (0, 0)

        class Undecided:
            def __bool__(self):
                raise LookupError("no answer")

        with pytest.raises(LookupError, match="no answer"):
            _core._set_interface_cache(Undecided())
        assert _core._interface_cache_info()["enabled"] is False
    finally:
        assert _core._set_interface_cache([1])["enabled"] is True
    assert converted(holding(iface))[0] == (0, 1)
    assert converted(holding(iface))[0] == (1, 0)


def test_records_are_kept_in_this_interpreter():
    """The main interpreter keeps records on every CPython before 3.14 (free-threaded builds included): the tests
    above that need them skip where none are kept, so this says where that must not be."""
    expected = sys.version_info < (3, 14)
    assert _core._interface_cache_info()["enabled"] is expected


@kept_only
def test_turning_keeping_off_forgets_the_record_of_every_slot():
    """Off empties every slot, not only the ones its dicts' events would: turned on again, each dict kept before
    (one in each of the four slots, picked by its address) is read and kept afresh, never served the old record."""
    x = np.arange(6.0)
    made, slots = [], set()
    while len(slots) < 4:
        holder = holding(dict(x.__array_interface__))
        made.append(holder)
        slots.add(id(holder.__array_interface__) >> 6 & 3)
    kept = {id(h.__array_interface__) >> 6 & 3: h for h in made}
    for holder in kept.values():
        assert converted(holder)[0] == (0, 1)
        assert converted(holder)[0] == (1, 0)
    try:
        _core._set_interface_cache(False)
    finally:
        _core._set_interface_cache(True)
    for slot, holder in sorted(kept.items()):
        assert (slot, converted(holder)[0]) == (slot, (0, 1))


@pytest.mark.parametrize("value, error, match", [
    (-1, ValueError, "microseconds must be 0 to 1000000, not -1"),
    (1000001, ValueError, "microseconds must be 0 to 1000000, not 1000001"),
    (2 ** 70, OverflowError, "too large"),
    ("5", TypeError, "integer"),
], ids=["negative", "past a second", "past a C long", "a str"])
def test_the_store_delay_hook_refuses_what_is_not_a_number_of_microseconds(value, error, match):
    """_set_record_store_delay takes 0 to 1000000 microseconds; anything else raises and leaves it as it was."""
    with pytest.raises(error, match=match):
        _core._set_record_store_delay(value)
    for good in (0, 1000000):
        assert _core._set_record_store_delay(good) is None
    _core._set_record_store_delay(0)


@kept_only
@pytest.mark.skipif(not bool(__import__("sysconfig").get_config_var("Py_GIL_DISABLED")),
                    reason="with the GIL a record is kept as soon as it is read: the hook makes nothing wait")
def test_the_store_delay_makes_each_store_wait_and_no_reuse():
    """On free-threaded builds each store waits the hook's delay, twice (between the read and the store, and inside
    the slot's lock: the windows the threads tests need); the longest delay, a whole second, is a second each time.
    A record's reuse does not wait, and 0 turns the wait off."""
    import time

    made = holding(dict(np.arange(6.0).__array_interface__))
    _core._set_record_store_delay(1000000)
    try:
        began = time.monotonic()
        assert converted(made)[0] == (0, 1)
        stored = time.monotonic() - began
        assert converted(made)[0] == (1, 0)
    finally:
        _core._set_record_store_delay(0)
    assert stored >= 2.0  # a second between the read and the store, a second inside the lock
    made.__array_interface__["shape"] = (3, 2)
    began = time.monotonic()
    assert converted(made)[0] == (0, 1)
    assert time.monotonic() - began < 0.5


@pytest.mark.parametrize("length", [0, 4], ids=["empty", "four bytes"])
def test_a_dict_over_a_buffer_object_is_never_kept(length):
    """A buffer object's memory is held by an export per conversion, and can move between them (a bytearray that
    grows): a dict whose data is one is read afresh every time, even an empty one, and each tensor holds its own
    export."""
    data = bytearray(length)
    made = holding({"shape": (length,), "typestr": "|u1", "data": data, "version": 3})
    _, stores = counts()
    for _ in range(3):
        capsule = cai2dlpack(made)
        with pytest.raises(BufferError):
            data.extend(b"more")  # the export this tensor holds forbids it
        del capsule
    assert counts()[1] == stores
