"""Wrong calls, each on a line whose comment says why it is rejected: tests/cpu/test_typing.py checks that
mypy --strict reports an error on exactly those lines, so the stub is seen to constrain callers."""
import array
from typing import Any

from cai_dlpack import DLPackShim, DLPackView, cai2dlpack, cuda_runtime_info, dlpack2cai, options


class HostArray:
    def __init__(self) -> None:
        self.memory = array.array("f", [1.0])
        self.__array_interface__: dict[str, Any] = {
            "shape": (1,), "typestr": "<f4", "data": (self.memory.buffer_info()[0], False), "version": 3}


def wrong(host: HostArray) -> None:
    cai2dlpack(host, 1)  # rejected: stream is keyword-only
    cai2dlpack(host, stream="default")  # rejected: not a stream
    cai2dlpack(host, max_version=1)  # rejected: a (major, minor) tuple
    view = dlpack2cai(cai2dlpack(host), max_version=(1, 0))  # rejected: dlpack2cai has no max_version
    view.shape = (1,)  # rejected: read-only
    name: int = view.typestr  # rejected: typestr is a str
    DLPackShim(host).__dlpack__(copy="no")  # rejected: copy is a bool or None
    DLPackShim(host).__dlpack_device__(0)  # rejected: takes no argument
    options(sync="off")  # rejected: a bool or None
    cuda_runtime_info()["driver"]  # rejected: no such key
    print(name)


class Subclass(DLPackView):  # rejected: DLPackView cannot be subclassed
    pass
