"""How much of the C heap is in use, for tests of C memory a path must give back (glibc's mallinfo2)."""
import ctypes


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]


def c_heap_bytes():
    """Bytes the C heap has handed out and not taken back (glibc's mallinfo2: small blocks and mapped ones), or
    None where it cannot say (no mallinfo2, or an allocator such as ASan's that does not fill it in)."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def used():
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    before = used()
    probe = libc.malloc(1 << 20)
    counted = used() - before >= 1 << 20
    libc.free(probe)
    return used() if counted else None
