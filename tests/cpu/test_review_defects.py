"""Defects a review of the C core found, each seen the way a user meets it: a producer's absurd
__dlpack_device__, a borrowed tensor whose buffer dies with the call, the errors __dlpack__ raises for
data DLPack cannot describe, and the public header's own usage example."""
import array
import gc
import os
import re
import subprocess
import sysconfig
import weakref

import numpy as np
import pytest

import cai_dlpack
from cai_dlpack import DLPackShim, UnsupportedArrayError, cai2dlpack
from support import c_example

from support.optional import needs_tvm_ffi, tvm_ffi

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


@pytest.fixture(scope="module")
def example():
    return c_example.build()


class AbsurdDevice:
    """A producer whose __dlpack_device__ names a device type that fits no C integer."""

    def __init__(self, device):
        self.device = device

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None, max_version=None):
        raise AssertionError("never reached: the device is refused first")


@pytest.mark.parametrize("device", [(2**70, 0), (-(2**70), 0), (-1, 0), ("cpu", 0), (1,), None])
def test_producer_device_that_is_not_a_device_is_refused_clearly(example, device):
    with pytest.raises(ValueError, match=r"__dlpack_device__\(\) returned .*not a \(device_type, device_id\) pair"):
        example.managed(AbsurdDevice(device), 1)


class FreshBuffer:
    """An array interface whose 'data' is a buffer object made anew on each access, which NumPy's protocol
    allows: nothing but the caller holds it."""

    def __init__(self):
        self.made = []

    @property
    def __array_interface__(self):
        buffer = array.array("d", [1.0, 2.0, 3.0])
        self.made.append(weakref.ref(buffer))
        return {"shape": (3,), "typestr": "<f8", "data": buffer, "version": 3}


class HeldBuffer(FreshBuffer):
    """The same, but the object keeps the buffer it names: the memory lives as long as the object."""

    def __init__(self):
        super().__init__()
        self.buffer = array.array("d", [1.0, 2.0, 3.0])

    @property
    def __array_interface__(self):
        self.made.append(weakref.ref(self.buffer))
        return {"shape": (3,), "typestr": "<f8", "data": self.buffer, "version": 3}


def test_borrowed_tensor_of_a_buffer_that_dies_with_the_call_is_refused(example):
    obj = FreshBuffer()
    with pytest.raises(BufferError, match="array that FreshBuffer's __array_interface__ 'data' names is held by nothing"):
        example.fill(obj, -1)
    with pytest.raises(BufferError, match="held by nothing but this call"):
        example.exchange_dltensor(DLPackShim(obj))
    gc.collect()
    assert [ref() for ref in obj.made] == [None, None]  # refused, and nothing kept


def test_borrowed_tensor_of_a_buffer_the_object_holds_is_lent(example):
    obj = HeldBuffer()
    fields = example.fill(obj, -1)
    assert fields["data"] == obj.buffer.buffer_info()[0] and fields["shape"] == (3,)
    assert obj.made[-1]() is obj.buffer


def test_owning_tensor_of_a_fresh_buffer_keeps_it_alive(example):
    obj = FreshBuffer()
    capsule = cai2dlpack(obj, max_version=(1, 0))
    gc.collect()
    assert obj.made[-1]() is not None  # the capsule holds the buffer
    assert example.managed(obj, -1)["shape"] == (3,)
    del capsule
    gc.collect()
    assert [ref() for ref in obj.made] == [None, None]


UNDESCRIBABLE = [
    (np.zeros(3, "M8[ns]"), "'typestr' '<M8[ns]' has no DLPack equivalent"),
    (np.zeros(3, ">f4"), "'typestr' '>f4' has non-native byte order"),
    (np.zeros(3, [("a", "<f4"), ("b", "u1")])["a"], "'strides'[0] is 5 bytes, not a multiple of the itemsize 4"),
]


@pytest.mark.parametrize("array_,message", UNDESCRIBABLE, ids=["datetime64", "big-endian", "strides"])
def test_dlpack_raises_buffer_error_for_what_dlpack_cannot_describe(array_, message):
    for call in (lambda: DLPackShim(array_).__dlpack__(), lambda: DLPackShim(array_).__dlpack__(max_version=(1, 0)),
                 lambda: np.from_dlpack(DLPackShim(array_)), lambda: cai2dlpack(array_),
                 *([lambda: tvm_ffi.from_dlpack(DLPackShim(array_))] if tvm_ffi is not None else [])):
        with pytest.raises(BufferError, match=re.escape(message)) as info:
            call()
        # Still a ValueError, as such data always was for cai2dlpack's callers.
        assert isinstance(info.value, ValueError) and isinstance(info.value, UnsupportedArrayError)


class Holder:
    def __init__(self, **entries):
        iface = {"shape": (3,), "typestr": "<f4", "data": (8, False), "version": 3, **entries}
        self.__array_interface__ = {key: value for key, value in iface.items() if value is not None}


@pytest.mark.parametrize("entries,error,message", [
    (dict(typestr=4), TypeError, "'typestr' must be a str, not int"),
    (dict(shape=None), ValueError, "lacks the required key 'shape'"),
    (dict(strides=(4, 4)), ValueError, "'strides' has 2 entries but 'shape' has 1"),
])
def test_malformed_interfaces_keep_type_and_value_errors(entries, error, message):
    with pytest.raises(error, match=re.escape(message)) as info:
        DLPackShim(Holder(**entries)).__dlpack__()
    assert not isinstance(info.value, BufferError)


def test_supported_types_in_messages_come_from_the_table():
    with pytest.raises(UnsupportedArrayError) as info:
        cai2dlpack({"shape": (1,), "typestr": "<f16", "data": (8, False), "version": 3}, owner=object())
    typestrs, names = re.search(r"supported: (.*); by name \(.*?\): (.*)\)", str(info.value)).groups()
    # Every listed typestr converts; every listed name converts when named.
    for kind_size in typestrs.split(", "):
        typestr = ("|" if kind_size[1:] == "1" else "<") + kind_size
        iface = {"shape": (1,), "typestr": typestr, "data": (8, False), "version": 3}
        assert cai2dlpack(Holder(**iface)) is not None
    for name in names.split(", "):
        itemsize = 2 if name == "bfloat16" else 1
        assert cai2dlpack(Holder(typestr=f"|V{itemsize}", shape=(1,)), dtype=name) is not None
    assert {"b1", "i8", "u2", "f2", "c16"} <= set(typestrs.split(", "))
    assert {"bfloat16", "float8_e4m3fn", "float4_e2m1fn_x2"} <= set(names.split(", "))


@needs_tvm_ffi
def test_header_usage_example_compiles():
    """The usage lines at the top of the public header, compiled as a caller would write them."""
    import tvm_ffi.libinfo

    with open(os.path.join(ROOT, "include", "cai_dlpack", "cai_dlpack.h")) as file:
        header = file.read()
    usage = re.search(r"/\* cai_dlpack C API.*?\n \*\n(.*?)\n \*\n", header, re.S).group(1)
    lines = [line[4:].split("//")[0] for line in usage.splitlines()]
    source = ("#include <cai_dlpack/cai_dlpack.h>\nstatic void launch_kernel(void *data, ...) { (void)data; }\n"
              "PyObject *use(PyObject *obj, int64_t stream) {\n" + "\n".join(lines).replace("...", "&t") +
              "\n    Py_RETURN_NONE;\n}\n")
    directory = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"cai_dlpack_usage_{os.getpid()}")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "usage.c")
    with open(path, "w") as file:
        file.write(source)
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    result = subprocess.run([compiler, "-c", "-Wall", "-Werror", "-I", sysconfig.get_paths()["include"],
                             "-I", os.path.join(ROOT, "include"), "-I", tvm_ffi.libinfo.find_dlpack_include_path(),
                             path, "-o", os.path.join(directory, "usage.o")], capture_output=True, text=True)
    assert result.returncode == 0, source + result.stderr


def test_empty_array_whose_byte_strides_overflow_reads_back():
    """Found by replaying the fuzz corpus: an empty array accepted by cai2dlpack has contiguous element
    strides that overflow in bytes; the view refused our own tensor until emptiness was checked first."""
    shape = (0, 61, 66, 463856467968, 44, 81)
    view = cai_dlpack.dlpack2cai(cai2dlpack(Holder(shape=shape, typestr="<i2")))
    assert view.shape == shape and view.strides is None and view.__array_interface__["data"] == (0, False)
