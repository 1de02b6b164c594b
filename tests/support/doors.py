"""Every C door a foreign caller has, called through ctypes the way a C extension calls it (the GIL held):
the three functions of cai_dlpack's C API table (the capsule cai_dlpack._C_API) and the five of the DLPack C
exchange API table on DLPackShim and DLPackView. Each wrapper turns the call's status into what Python would
see: the exception the door set, or SystemError when it failed without one (or succeeded with one set)."""
import ctypes

import cai_dlpack
from support.dlpack_ctypes import DLManagedTensorVersioned, DLTensor

_api = ctypes.pythonapi
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.Py_DecRef.argtypes = [ctypes.c_void_p]
_api.PyErr_Occurred.restype = ctypes.c_void_p

ManagedPointer = ctypes.POINTER(DLManagedTensorVersioned)

# The C API (include/cai_dlpack/cai_dlpack.h). PYFUNCTYPE: the GIL stays held and an exception the door set
# is raised on return.
ToManaged = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_int64, ctypes.POINTER(ManagedPointer))
FillTensor = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_int64, ctypes.POINTER(DLTensor),
                               ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64), ctypes.c_int,
                               ctypes.POINTER(ctypes.c_int))
ViewFromManaged = ctypes.PYFUNCTYPE(ctypes.c_void_p, ManagedPointer, ctypes.c_int64)


class CApi(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("to_managed_tensor", ToManaged),
                ("fill_tensor", FillTensor), ("view_from_managed_tensor", ViewFromManaged)]


# The DLPack C exchange API (dlpack.h's DLPackExchangeAPI).
SetError = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p)
Allocator = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.POINTER(DLTensor), ctypes.POINTER(ManagedPointer),
                              ctypes.c_void_p, SetError)
FromObject = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(ManagedPointer))
ToObject = ctypes.PYFUNCTYPE(ctypes.c_int, ManagedPointer, ctypes.POINTER(ctypes.c_void_p))
DLTensorFromObject = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(DLTensor))
WorkStream = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p))


class ExchangeApi(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("prev_api", ctypes.c_void_p),
                ("managed_tensor_allocator", Allocator), ("managed_tensor_from_py_object_no_sync", FromObject),
                ("managed_tensor_to_py_object_no_sync", ToObject),
                ("dltensor_from_py_object_no_sync", DLTensorFromObject), ("current_work_stream", WorkStream)]


C_API = CApi.from_address(_api.PyCapsule_GetPointer(cai_dlpack._core._C_API, b"cai_dlpack._C_API"))
EXCHANGE = ExchangeApi.from_address(
    _api.PyCapsule_GetPointer(cai_dlpack.DLPackShim.__dlpack_c_exchange_api__, b"dlpack_exchange_api"))


def _check_status(door, status):
    """A failed call (non-zero) must have raised already (ctypes raises what the door set)."""
    if status != 0:
        raise SystemError(f"{door} returned {status} without setting an exception")


def _steal_object(address):
    """The object a door returned as a new reference (address), as a Python value; the door's reference is
    dropped, ours kept."""
    obj = ctypes.cast(address, ctypes.py_object).value
    _api.Py_DecRef(address)
    return obj


class Owned:
    """An owning DLManagedTensorVersioned a door handed out; its deleter runs exactly once (delete())."""

    def __init__(self, pointer):
        self.pointer = pointer

    @property
    def tensor(self):
        return self.pointer.contents.dl_tensor

    def fields(self):
        return tensor_fields(self.tensor)

    def delete(self):
        pointer, self.pointer = self.pointer, None
        if pointer:
            pointer.contents.deleter(pointer)


def tensor_fields(t):
    """A DLTensor as plain values."""
    ndim = t.ndim
    return {"data": t.data or 0, "device": (t.device.device_type, t.device.device_id), "ndim": ndim,
            "dtype": (t.dtype.code, t.dtype.bits, t.dtype.lanes),
            "shape": tuple(t.shape[i] for i in range(ndim)) if ndim > 0 else (),
            "strides": None if not t.strides else tuple(t.strides[i] for i in range(ndim)),
            "byte_offset": t.byte_offset}


# ---- the C API ------------------------------------------------------------------------------------------

def to_managed_tensor(obj, stream):
    out = ManagedPointer()
    status = C_API.to_managed_tensor(obj, stream, ctypes.byref(out))
    _check_status("to_managed_tensor", status)
    assert out, "to_managed_tensor succeeded with no tensor"
    return Owned(out)


def fill_tensor(obj, stream, capacity=64, read_only=True, storage=None):
    """fill_tensor into arrays of `storage` entries (default: capacity); returns (fields, read_only)."""
    storage = capacity if storage is None else storage
    shape = (ctypes.c_int64 * max(storage, 1))()
    strides = (ctypes.c_int64 * max(storage, 1))()
    flag = ctypes.c_int(-7)
    out = DLTensor()
    status = C_API.fill_tensor(obj, stream, ctypes.byref(out), shape if storage else None,
                               strides if storage else None, capacity, ctypes.byref(flag) if read_only else None)
    _check_status("fill_tensor", status)
    return tensor_fields(out), (flag.value if read_only else None)


def view_from_managed_tensor(pointer, stream):
    """Steals pointer (a ManagedPointer)."""
    address = C_API.view_from_managed_tensor(pointer, stream)
    if not address:
        raise SystemError("view_from_managed_tensor returned NULL without setting an exception")
    return _steal_object(address)


# ---- the DLPack C exchange API --------------------------------------------------------------------------

class AllocationRefused(Exception):
    """The allocator's refusal: kind (the Python exception it names) and message, through SetError."""

    def __init__(self, kind, message):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


def allocate(dtype, shape, device, ndim=None, null_shape=False):
    """managed_tensor_allocator for a prototype of dtype (code, bits, lanes), shape, device (type, id);
    ndim overrides len(shape). Returns an Owned tensor, or raises AllocationRefused."""
    shape_array = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    prototype = DLTensor()
    prototype.device.device_type, prototype.device.device_id = device
    prototype.ndim = len(shape) if ndim is None else ndim
    prototype.dtype.code, prototype.dtype.bits, prototype.dtype.lanes = dtype
    prototype.shape = ctypes.cast(None if null_shape else shape_array, ctypes.POINTER(ctypes.c_int64))
    errors = []

    def record(context, kind, message):
        errors.append((context, kind.decode(), message.decode()))

    out = ManagedPointer()
    callback = SetError(record)
    status = EXCHANGE.managed_tensor_allocator(ctypes.byref(prototype), ctypes.byref(out), 1234, callback)
    if _api.PyErr_Occurred():
        raise SystemError("the allocator left a Python exception set")
    if status != 0:
        assert len(errors) == 1 and errors[0][0] == 1234 and not out, (status, errors, out)
        raise AllocationRefused(errors[0][1], errors[0][2])
    assert not errors and out, (errors, out)
    return Owned(out)


def managed_from_object(obj):
    out = ManagedPointer()
    _check_status("managed_tensor_from_py_object_no_sync", EXCHANGE.managed_tensor_from_py_object_no_sync(obj, ctypes.byref(out)))
    assert out
    return Owned(out)


def object_from_managed(pointer):
    """managed_tensor_to_py_object_no_sync: steals pointer."""
    out = ctypes.c_void_p()
    _check_status("managed_tensor_to_py_object_no_sync", EXCHANGE.managed_tensor_to_py_object_no_sync(pointer, ctypes.byref(out)))
    assert out.value
    return _steal_object(out.value)


def dltensor_from_object(obj):
    out = DLTensor()
    _check_status("dltensor_from_py_object_no_sync", EXCHANGE.dltensor_from_py_object_no_sync(obj, ctypes.byref(out)))
    return tensor_fields(out)


def current_work_stream(device_type, device_id):
    out = ctypes.c_void_p(7)
    _check_status("current_work_stream", EXCHANGE.current_work_stream(device_type, device_id, ctypes.byref(out)))
    return out.value or 0
