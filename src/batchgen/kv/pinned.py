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

Before it is registered, the map's pages are faulted in by torch's intra-op threads
(one write a page, `_prefault`): registration would fault them in one at a time on one
thread, which is most of the time pinning a large pool takes (seconds per 8 GiB); the
map, a parallel first touch, then registration is how large pinned pools are made fast
elsewhere too. Where the process's CPUs span NUMA nodes one thread touches them, so
that the pool stays on one node as before.

Device pools (`pool_zeros`) start zero-filled: torch.zeros on a GPU; on the CPU an
anonymous map too, which the kernel zero-fills a page at its first touch, so a CPU pool
costs the pages a run writes, not a memset of all of them up front.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import weakref
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def _registered(shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """A tensor over anonymous memory of `nbytes`, registered with CUDA until its storage
    is freed (views keep it), and unregistered before the memory is unmapped: the
    finalizer holds the map until it has run."""
    memory = mmap.mmap(-1, nbytes)
    _prefault(memory)
    t = torch.frombuffer(memoryview(memory), dtype=dtype, count=math.prod(shape)).view(shape)
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
    weakref.finalize(t.untyped_storage(), _unregister, t.data_ptr(), memory)
    return t


def _prefault(memory: mmap.mmap) -> None:
    """Every page of a fresh anonymous map faulted in (zero-filled, as it reads already):
    one byte a page written, the pages shared out among torch's intra-op threads where
    this process runs on one NUMA node. A page lands on the node of the thread that
    first touches it: where the process spans nodes, threads on several would scatter
    the pool across them (DMA from a remote node is slower), so one thread touches it
    all, placing it as registration's own faults did."""
    pages = torch.frombuffer(memoryview(memory), dtype=torch.uint8)
    threads = torch.get_num_threads()
    one_thread = threads > 1 and _numa_nodes() > 1
    if one_thread:
        torch.set_num_threads(1)
    try:
        pages[:: mmap.PAGESIZE].fill_(0)
    finally:
        if one_thread:
            torch.set_num_threads(threads)


def _numa_nodes(node_dir: str = "/sys/devices/system/node") -> int:
    """How many NUMA nodes hold CPUs this process may run on (1 where Linux's node
    files or the affinity call are missing)."""
    try:
        allowed = os.sched_getaffinity(0)
        lists = [f.read_text() for f in Path(node_dir).glob("node[0-9]*/cpulist")]
    except (AttributeError, OSError):
        return 1
    return max(1, sum(bool(cpu_list(text) & allowed) for text in lists))


def cpu_list(text: str) -> set[int]:
    """The CPUs of a Linux cpulist ("0-3,8,10-11")."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


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


def pool_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A device pool's zero-filled tensor. On a GPU torch.zeros (its memset is a producer
    on the compute stream: copy_rules.py, rule 4). On the CPU anonymous memory of the
    exact size, which reads zero and is faulted in (zero-filled by the kernel) a page at
    its first write: a memset of the CPU default's 1 GiB took ~0.45 s and as much resident
    memory an engine, on every tensor-parallel rank, however few pages a run wrote. The
    map is unmapped once the tensor's storage is freed (its last view gone)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    memory = mmap.mmap(-1, max(1, count * dtype.itemsize))
    raw = torch.frombuffer(memoryview(memory), dtype=torch.uint8, count=count * dtype.itemsize)
    return raw.view(dtype).view(shape)
