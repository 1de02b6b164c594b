"""Every public name of cai_dlpack, used the way a typed program uses it. Never run: tests/cpu/test_typing.py
checks it with mypy --strict against the installed package (its stub and py.typed), where it must pass."""
import array
from typing import Any

import numpy

import cai_dlpack
from cai_dlpack import (
    CUDART_HEADER_MAJOR,
    DLPACK_VERSION,
    CudaError,
    DLPackShim,
    DLPackView,
    cai2dlpack,
    cuda_runtime_info,
    dlpack2cai,
    get_include,
    options,
)


class HostArray:
    """Host memory described by an array-interface dict."""

    def __init__(self) -> None:
        self.memory = array.array("f", [1.0, 2.0, 3.0])
        address, length = self.memory.buffer_info()
        self.__array_interface__: dict[str, Any] = {
            "shape": (length,), "typestr": "<f4", "data": (address, False), "version": 3}


class Stream:
    """A stream object as CuPy, Numba and cuda.core make them."""

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, 0x1000)


def capsules(host: HostArray, stream: Stream) -> list[object]:
    return [
        cai2dlpack(host),
        cai2dlpack(host, stream=1, max_version=(1, 0)),
        cai2dlpack(host.__array_interface__, owner=host, stream=stream, max_version=None),
        cai2dlpack(host, dtype="bfloat16"),
        cai2dlpack(host, dl_device=(1, 0), copy=True),
        cai2dlpack(host, dtype=numpy.float32),
    ]


def views(host: HostArray, stream: Stream) -> DLPackView:
    view = dlpack2cai(cai2dlpack(host), stream=None)
    view = dlpack2cai(DLPackShim(host), stream=stream)
    view = dlpack2cai(numpy.arange(3.0), stream=-1)
    shape: tuple[int, ...] = view.shape
    strides: tuple[int, ...] | None = view.strides
    typestr: str = view.typestr
    device: tuple[int, int] = view.device
    read_only: bool = view.read_only
    interface: dict[str, Any] = view.__array_interface__
    cuda_interface: dict[str, Any] = view.__cuda_array_interface__
    print(shape, strides, typestr, device, read_only, interface, cuda_interface)
    with memoryview(view) as through:
        print(through.tolist())
    dlpack2cai(view.__dlpack__(stream=2, max_version=(1, 3), dl_device=view.__dlpack_device__(), copy=False))
    return view


def shims(host: HostArray, stream: Stream) -> numpy.ndarray[Any, Any]:
    shim = DLPackShim(host)
    typed = DLPackShim(host, dtype="bfloat16")
    wrapped: object = shim.obj
    device: tuple[int, int] = shim.__dlpack_device__()
    print(wrapped, device, typed.__dlpack__(stream=stream, max_version=(1, 0), dl_device=(1, 0), copy=None))
    return numpy.from_dlpack(shim)


def settings_and_runtime() -> str:
    settings = options(sync=True, export_stream=None)
    sync: bool = settings["sync"]
    export_stream: bool = options()["export_stream"]
    try:
        info = cuda_runtime_info()
        path: str = info["path"]
        source: str = info["source"]
        version: int = info["version"]
        count: int = info["device_count"]
        print(path, source, info["file"], version, count)
    except CudaError as error:
        call: str = error.call
        code: int = error.code
        name: str = error.name
        print(call, code, name)
    major, minor = DLPACK_VERSION
    header_major: int = CUDART_HEADER_MAJOR
    print(sync, export_stream, major + minor, header_major)
    return cai_dlpack.__version__ + get_include()
