"""Host pools pinned at exactly their size.

`torch.empty(..., pin_memory=True)` goes through torch's caching host allocator, which
rounds every block up to the next power of two: a 40 GiB host tier pins 64 GiB, a 100 GiB
one 128 GiB (as much as the whole host of some GPU machines), and the rounding is memory
no page can use. A pool is one long-lived block, so it gains nothing from the cache:
`host_empty` maps anonymous memory of the exact size (page-aligned, zero-filled) and
registers it with CUDA (`cudaHostRegister`, what the runtime does for pinned memory it
did not allocate), so copies to and from it are asynchronous DMA like any pinned
memory's. The registration is undone when the tensor's storage is freed (its last view
gone), before the memory is unmapped. Where registration fails, the pool falls back to the caching
allocator (rounded, with a warning) rather than failing.
"""

from __future__ import annotations

import logging
import math
import mmap
import weakref

import torch

logger = logging.getLogger(__name__)


def _registered(shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """A tensor over anonymous memory of `nbytes`, registered with CUDA until its storage
    is freed (views keep it), and unregistered before the memory is unmapped: the
    finalizer holds the map until it has run."""
    memory = mmap.mmap(-1, nbytes)
    t = torch.frombuffer(memoryview(memory), dtype=dtype, count=math.prod(shape)).view(shape)
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
    weakref.finalize(t.untyped_storage(), _unregister, t.data_ptr(), memory)
    return t


def _unregister(ptr: int, memory: mmap.mmap) -> None:
    try:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))
    except Exception as e:  # at interpreter exit CUDA may be gone already
        logger.debug("cudaHostUnregister failed: %s", e)
    del memory  # unmapped once nothing else holds it


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor (zero-filled when pinned), pinned at exactly its size
    when `pin` (see the module's docstring)."""
    if not pin:
        return torch.empty(shape, dtype=dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    try:
        return _registered(tuple(shape), dtype, nbytes)
    except Exception as e:
        logger.warning(
            "pinning %.2f GiB of host memory with cudaHostRegister failed (%s): using "
            "torch's pinned allocator, which rounds it up to a power of two",
            nbytes / 2**30,
            e,
        )
        return torch.empty(shape, dtype=dtype, pin_memory=True)
