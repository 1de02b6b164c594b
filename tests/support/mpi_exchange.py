"""Run under `mpiexec -n 2`: rank 0 sends, rank 1 receives, through mpi4py's own reading of message buffers,
every kind of object cai_dlpack hands out (DLPackShim, DLPackView of NumPy and of torch, low-precision views).
Both ranks build the same cases; rank 1 receives into a DLPackView of its own zeroed memory and prints one line
per case: "<case>: ok" when the bits it received are the bits rank 0 sent, else both."""
import numpy as np
from mpi4py import MPI

from cai_dlpack import DLPackShim, dlpack2cai

comm = MPI.COMM_WORLD


def cases():
    """(case, what rank 0 sends, the bits it holds, a zeroed target for rank 1, the target's bits)."""
    values = np.arange(12, dtype=np.float64).reshape(3, 4) * 1.5
    target = np.zeros((3, 4))
    yield "shim of a NumPy array", DLPackShim(values), values, target, lambda: target
    target = np.zeros((3, 4))
    yield "view of a NumPy array", dlpack2cai(values), values, target, lambda: target
    try:
        import torch
    except ImportError:
        return
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        bits_type = torch.int16 if name == "bfloat16" else torch.uint8
        bits = torch.arange(10, dtype=bits_type) + 60
        target = torch.zeros_like(bits).view(getattr(torch, name))
        yield (f"view of a torch {name} tensor", dlpack2cai(bits.view(getattr(torch, name))), bits.numpy(), target,
               lambda target=target, bits_type=bits_type: target.view(bits_type).numpy())


for case, outgoing, sent, target, received in cases():
    if comm.Get_rank() == 0:
        comm.Send(outgoing, dest=1, tag=7)
    else:
        comm.Recv(dlpack2cai(target), source=0, tag=7)  # written through a view of the receiver's memory
        got = received()
        print(f"{case}: {'ok' if np.array_equal(got, sent) else f'received {got!r}, sent {sent!r}'}", flush=True)
