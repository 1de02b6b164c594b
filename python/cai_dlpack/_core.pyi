# Types of the C extension cai_dlpack._core, for editors and type checkers. The C functions carry the
# same signatures as text (inspect.signature); tests/cpu/test_typing.py checks that the two agree.
from typing import Any, ClassVar, Literal, Protocol, TypedDict, final

from typing_extensions import CapsuleType, Self, TypeAlias, disjoint_base

class _SupportsCudaStream(Protocol):
    """A stream object (CuPy, Numba, cuda.core, ...): __cuda_stream__() -> (version, handle)."""

    def __cuda_stream__(self) -> tuple[int, int]: ...

# The array API's stream: an int (1 legacy default, 2 per-thread default, a handle, -1 no ordering),
# a stream object, or None (the legacy default).
_Stream: TypeAlias = int | _SupportsCudaStream | None

class _RuntimeInfo(TypedDict):
    path: str
    file: str
    source: Literal["CAI_DLPACK_CUDART", "preloaded", "loader", "pip wheel"]
    version: int
    device_count: int

class _Options(TypedDict):
    sync: bool
    export_stream: bool
    trust_streams: bool

DLPACK_VERSION: tuple[int, int]
CUDART_HEADER_MAJOR: int
_C_API: CapsuleType

class UnsupportedArrayError(BufferError, ValueError):
    """Valid data the other protocol cannot describe."""

class CudaError(RuntimeError):
    call: str
    code: int
    name: str

def cai2dlpack(
    obj: object,
    /,
    *,
    stream: _Stream = None,
    max_version: tuple[int, int] | None = None,
    owner: object = None,
    dtype: object = None,
    dl_device: tuple[int, int] | None = None,
    copy: bool | None = None,
) -> CapsuleType: ...
def dlpack2cai(x: object, /, *, stream: _Stream = None) -> DLPackView: ...
def options(
    *, sync: bool | None = None, export_stream: bool | None = None, trust_streams: bool | None = None
) -> _Options: ...
def cuda_runtime_info() -> _RuntimeInfo: ...

@disjoint_base  # its C layout cannot be combined with another built-in base
class DLPackShim:
    __dlpack_c_exchange_api__: ClassVar[CapsuleType]
    __c_dlpack_exchange_api__: ClassVar[int]
    def __new__(cls, obj: object, *, dtype: object = None) -> Self: ...
    @property
    def obj(self) -> object: ...
    def __dlpack__(
        self,
        *,
        stream: _Stream = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> CapsuleType: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...

@final
class DLPackView:
    __dlpack_c_exchange_api__: ClassVar[CapsuleType]
    __c_dlpack_exchange_api__: ClassVar[int]
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def strides(self) -> tuple[int, ...] | None: ...
    @property
    def typestr(self) -> str: ...
    @property
    def device(self) -> tuple[int, int]: ...
    @property
    def read_only(self) -> bool: ...
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...
    @property
    def __array_interface__(self) -> dict[str, Any]: ...
    def __dlpack__(
        self,
        *,
        stream: _Stream = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> CapsuleType: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...
    # Host-accessible views export a buffer: memoryview(view). The slot is named __buffer__ from Python 3.12 on
    # and declared for every version, as typeshed declares it for bytes.
    def __buffer__(self, flags: int, /) -> memoryview: ...
