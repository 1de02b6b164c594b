"""ctypes mirrors of dlpack.h, to read capsules field by field and to make arbitrary DLPack tensors."""
import ctypes

kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged, kDLROCM = 1, 2, 3, 13, 10
kDLInt, kDLUInt, kDLFloat, kDLOpaqueHandle, kDLBfloat, kDLComplex, kDLBool = 0, 1, 2, 3, 4, 5, 6
READ_ONLY = 1


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


LegacyDeleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", LegacyDeleter)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


VersionedDeleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))
DLManagedTensorVersioned._fields_ = [
    ("version", DLPackVersion),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", VersionedDeleter),
    ("flags", ctypes.c_uint64),
    ("dl_tensor", DLTensor),
]

_api = ctypes.pythonapi
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetName.restype = ctypes.c_char_p
_api.PyCapsule_GetName.argtypes = [ctypes.py_object]
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def capsule_name(capsule):
    return _api.PyCapsule_GetName(capsule).decode()


def read_capsule(capsule):
    """Every field of an unconsumed capsule's tensor, as plain Python values (the capsule is not consumed)."""
    name = capsule_name(capsule)
    address = _api.PyCapsule_GetPointer(capsule, name.encode())
    fields = {"name": name}
    if name == "dltensor_versioned":
        managed = DLManagedTensorVersioned.from_address(address)
        fields["version"] = (managed.version.major, managed.version.minor)
        fields["flags"] = managed.flags
    else:
        managed = DLManagedTensor.from_address(address)
    t = managed.dl_tensor
    fields.update(
        data=t.data or 0,
        device=(t.device.device_type, t.device.device_id),
        ndim=t.ndim,
        dtype=(t.dtype.code, t.dtype.bits, t.dtype.lanes),
        shape=tuple(t.shape[i] for i in range(t.ndim)),
        strides=None if not t.strides else tuple(t.strides[i] for i in range(t.ndim)),
        byte_offset=t.byte_offset,
        has_deleter=bool(managed.deleter),
    )
    return fields


class MadeTensor:
    """An arbitrary DLPack tensor and its capsule; records how often its deleter ran."""

    def __init__(self, *, data=0, device=(kDLCPU, 0), dtype=(kDLFloat, 32, 1), shape=(), strides=None,
                 byte_offset=0, versioned=True, version=(1, 0), flags=0, null_shape=False, ndim=None):
        self.deleted = 0
        self.shape_array = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self.strides_array = None if strides is None else (ctypes.c_int64 * max(len(strides), 1))(*strides)
        if versioned:
            self.managed = DLManagedTensorVersioned()
            self.managed.version = DLPackVersion(*version)
            self.managed.flags = flags
            self.deleter = VersionedDeleter(self._delete)
        else:
            self.managed = DLManagedTensor()
            self.deleter = LegacyDeleter(self._delete)
        self.managed.deleter = self.deleter
        t = self.managed.dl_tensor
        t.data = data
        t.device = DLDevice(*device)
        t.ndim = len(shape) if ndim is None else ndim
        t.dtype = DLDataType(*dtype)
        t.shape = ctypes.cast(None if null_shape else self.shape_array, ctypes.POINTER(ctypes.c_int64))
        if self.strides_array is not None:
            t.strides = ctypes.cast(self.strides_array, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = byte_offset
        name = b"dltensor_versioned" if versioned else b"dltensor"
        self.capsule = _api.PyCapsule_New(ctypes.addressof(self.managed), name, None)

    def _delete(self, _pointer):
        self.deleted += 1
