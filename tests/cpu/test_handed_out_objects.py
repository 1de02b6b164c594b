"""Everything the bridge hands out is immutable or the receiver's own: each interface dict a view gives (its
`descr` list included), its shape and strides, its device, the options and runtime information. Each test edits
what it was handed the way a receiver may, then converts again and checks that no later answer changed."""
import ctypes

import numpy as np
import pytest

import cai_dlpack
from cai_dlpack import DLPackShim, cai2dlpack, dlpack2cai, options
from support.cai_objects import CaiArray, register
from support.cuda_double import DEVICE
from support.optional import needs_torch, torch

LOW_PRECISION = ["bfloat16", "float8_e4m3fn", "float8_e5m2"]  # torch's names


def edit_dict(d):
    """Every edit a receiver may make of a dict it was handed, its lists included."""
    for value in list(d.values()):
        if isinstance(value, list):
            if value and isinstance(value[0], tuple):
                value[0] = ("float16", "<V2")
            value.append(("x", "|u1"))
    d["shape"] = (99,)
    d["typestr"] = "<f2"
    d["data"] = (8, True)
    d["strides"] = (2,)
    d["extra"] = object()


def answers(view):
    """Everything a view says about itself, deep-copied into fresh values."""
    host = view.device[0] in (1, 3, 13)
    iface = view.__array_interface__ if host else view.__cuda_array_interface__
    copied = {key: list(value) if isinstance(value, list) else value for key, value in iface.items()}
    return copied, view.shape, view.strides, view.typestr, view.device, view.read_only


def test_host_view_dicts_are_the_receivers_own():
    x = np.arange(12.0).reshape(3, 4)[:, ::2]
    view = dlpack2cai(x)
    before = answers(view)
    for _ in range(2):
        edit_dict(view.__array_interface__)
    assert answers(view) == before
    np.testing.assert_array_equal(np.asarray(view), x)
    np.testing.assert_array_equal(np.asarray(dlpack2cai(x)), x)


def test_device_view_dicts_are_the_receivers_own(cudart):
    host = np.zeros((4, 6), dtype=np.float32)
    register(cudart, host, DEVICE, device=1)
    view = dlpack2cai(cai2dlpack(CaiArray(host[:, 1:], stream=0x5000), stream=0x6000))
    before = answers(view)
    edit_dict(view.__cuda_array_interface__)
    assert answers(view) == before
    assert dlpack2cai(view).__cuda_array_interface__["shape"] == (4, 5)


@needs_torch
@pytest.mark.parametrize("name", LOW_PRECISION)
def test_low_precision_descr_is_the_receivers_own(name):
    """A view of a type no typestr names gives a descr list that carries the name: editing it (or appending to it)
    changes no other view, and no later conversion."""
    dtype = getattr(torch, name)
    t = torch.zeros(6, dtype=dtype)
    first = dlpack2cai(t)
    expected = [(str(dtype).split(".")[1], first.typestr)]
    edit_dict(first.__array_interface__)
    for view in (first, dlpack2cai(t), dlpack2cai(torch.zeros(2, dtype=dtype))):
        assert view.__array_interface__["descr"] == expected
        assert torch.from_dlpack(DLPackShim(view)).dtype == dtype


def test_shape_strides_and_device_are_immutable():
    x = np.arange(24.0).reshape(2, 3, 4)[:, ::-1]
    view = dlpack2cai(x)
    handed = [view.shape, view.strides, view.device, view.__array_interface__["shape"],
              view.__array_interface__["strides"], view.__array_interface__["data"], view.__dlpack_device__()]
    assert all(type(value) is tuple for value in handed)
    assert all(type(item) is int for value in handed for item in value if not isinstance(item, bool))


def test_options_are_the_receivers_own():
    before = options()
    handed = options()
    handed["sync"] = not handed["sync"]
    handed.clear()
    assert options() == before


def test_runtime_information_is_the_receivers_own(cudart):
    before = cai_dlpack.cuda_runtime_info()
    handed = cai_dlpack.cuda_runtime_info()
    if isinstance(handed, dict):
        for key in list(handed):
            handed[key] = None
        handed["extra"] = 1
    assert cai_dlpack.cuda_runtime_info() == before


def test_a_view_exported_again_is_unaffected_by_edits_of_its_capsule():
    """A capsule's tensor belongs to the consumer that takes it: a consumer that edits the shape it was given
    (through the DLTensor) changes neither the view it came from nor that view's later exports."""
    from support.dlpack_ctypes import DLManagedTensorVersioned

    x = np.arange(6.0).reshape(2, 3)
    view = dlpack2cai(x)
    capsule = view.__dlpack__(max_version=(1, 0))
    ctypes.pythonapi.PyCapsule_GetPointer.restype = ctypes.c_void_p
    ctypes.pythonapi.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    managed = DLManagedTensorVersioned.from_address(
        ctypes.pythonapi.PyCapsule_GetPointer(capsule, b"dltensor_versioned"))
    managed.dl_tensor.shape[0] = 1
    managed.dl_tensor.strides[1] = 7
    assert view.shape == (2, 3) and view.strides == (24, 8)
    np.testing.assert_array_equal(np.from_dlpack(DLPackShim(view)), x)
    assert dlpack2cai(capsule).shape == (1, 3)  # the edited tensor is the consumer's own


@pytest.mark.parametrize("keywords,shared", [
    ({}, True), ({"copy": None}, True), ({"copy": False}, True), ({"dl_device": (1, 0)}, True),
    ({"dl_device": (1, 0), "copy": False}, True), ({"copy": True}, False), ({"dl_device": (1, 0), "copy": True}, False)])
def test_a_host_view_exported_again_shares_or_copies_as_its_keywords_ask(keywords, shared):
    """A view's own __dlpack__ reads each keyword as its own: copy=False and copy=None share the memory,
    copy=True copies it (and says so in the flags), the data's own device (kDLCPU, 0) is no request to move it."""
    from support.dlpack_ctypes import read_capsule

    array = np.arange(6, dtype=np.float64)
    view = dlpack2cai(array.__dlpack__(max_version=(1, 0)))
    fields = read_capsule(view.__dlpack__(max_version=(1, 0), **keywords))
    assert (fields["data"] == array.ctypes.data) == shared
    assert fields["flags"] & 2 == (0 if shared else 2)  # DLPACK_FLAG_BITMASK_IS_COPIED
    assert fields["device"] == (1, 0) and fields["shape"] == (6,)


def test_a_host_view_asked_for_another_device_without_a_copy_is_refused():
    """dl_device naming a device the data is not on, with no copy allowed, is the array API's BufferError."""
    view = dlpack2cai(np.arange(6.0).__dlpack__(max_version=(1, 0)))
    for copy in (None, False):
        with pytest.raises(BufferError, match="dl_device"):
            view.__dlpack__(max_version=(1, 0), dl_device=(2, 0), copy=copy)


def test_a_shim_tells_its_weak_references_when_it_goes():
    """A DLPackShim can be weakly referenced: when it goes, the reference reads None and its callback runs once."""
    import weakref

    shim = DLPackShim(np.arange(3.0))
    called = []
    ref = weakref.ref(shim, called.append)
    assert ref() is shim
    del shim
    assert ref() is None and called == [ref]
