"""Host pools pinned at exactly their size (kv/pinned.py).

On the CPU, CUDA's registration calls are replaced by a recorder, so the size asked
for, the pointer, the unregistration on release and the fallback are checked without
a GPU; the GPU test checks what the registration is for: the pool is pinned memory and
non-blocking copies through it round-trip.
"""

from __future__ import annotations

import gc
import logging
import mmap

import pytest
import torch

from batchgen.kv import pinned
from batchgen.kv.host_pool import HostPool
from batchgen.kv.layout import KVLayout
from batchgen.kv.state_pool import HostStatePool, StateLayout


def resident_bytes(ptr: int) -> int | None:
    """The resident bytes (Rss) of this process's mapping that holds address ptr, from
    /proc/self/smaps; None where that file is missing."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    return None


class FakeCudart:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.foreign: list[int] = []  # pools registered before the fake was installed
        self.resident: dict[int, int | None] = {}  # at registration

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        if self.fail:
            return 2  # cudaErrorMemoryAllocation
        self.registered[ptr] = nbytes
        self.resident[ptr] = resident_bytes(ptr)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        (self.unregistered if ptr in self.registered else self.foreign).append(ptr)
        return 0


def check_error(code: int) -> None:
    if code != 0:
        raise RuntimeError(f"CUDA error {code}")


@pytest.fixture
def cudart(monkeypatch):
    # Pools an earlier test left to the collector (on a GPU, the tier's, registered with
    # the real runtime) are released through it now, not through the recorder.
    gc.collect()
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "check_error", check_error)
    return fake


def test_pinned_pool_is_registered_at_its_exact_size_and_released(cudart):
    shape = (3, 5, 7)  # 105 float32s: 420 bytes, nowhere near a power of two
    t = pinned.host_empty(shape, torch.float32, pin=True)
    assert t.shape == shape and t.dtype == torch.float32
    assert cudart.registered == {t.data_ptr(): 420}
    t[1, 2, 3] = 4.5  # writable, and the registered memory is the tensor's
    assert float(t.view(-1)[1 * 35 + 2 * 7 + 3]) == 4.5
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert cudart.unregistered == [ptr]


def test_the_pages_are_faulted_in_before_registration(cudart):
    """Registration finds every page of the pool resident (our threads faulted them in;
    registration would fault them one by one), and the pool still reads as zeros."""
    nbytes = 64 * mmap.PAGESIZE + 100  # a partial last page too
    t = pinned.host_empty((nbytes,), torch.uint8, pin=True)
    resident = cudart.resident[t.data_ptr()]
    if resident is None:
        pytest.skip("no /proc/self/smaps here")
    assert resident == 65 * mmap.PAGESIZE
    assert not t.any()


def test_a_view_keeps_the_registration(cudart):
    t = pinned.host_empty((4, 8), torch.bfloat16, pin=True)
    ptr = t.data_ptr()
    row = t[2]
    del t
    gc.collect()
    assert cudart.unregistered == []  # the storage, and its registration, live on
    row.fill_(1.0)
    del row
    gc.collect()
    assert cudart.unregistered == [ptr]


def test_failed_registration_falls_back_to_the_caching_allocator(monkeypatch, caplog):
    fake = FakeCudart(fail=True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "check_error", check_error)
    asked = []
    real_empty = torch.empty

    def empty(*shape, pin_memory=False, **kw):
        asked.append(pin_memory)
        return real_empty(*shape, **kw)  # this machine has no CUDA to pin with

    monkeypatch.setattr(torch, "empty", empty)
    with caplog.at_level(logging.WARNING, logger="batchgen.kv.pinned"):
        t = pinned.host_empty((6, 10), torch.float16, pin=True)
    assert t.shape == (6, 10) and asked == [True]
    assert "cudaHostRegister failed" in caplog.text and "power of two" in caplog.text


def test_unpinned_pools_are_plain_tensors(monkeypatch):
    def no_cuda():
        raise AssertionError("an unpinned pool must not call CUDA")

    monkeypatch.setattr(torch.cuda, "cudart", no_cuda)
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype=torch.float32)
    pool = HostPool(layout, num_pages=3, pin=False)
    assert pool.kv.shape == layout.host_shape(3)


def test_host_pools_pin_through_host_empty(cudart):
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype=torch.float32)
    pool = HostPool(layout, num_pages=3, pin=True)
    assert cudart.registered == {pool.kv.data_ptr(): pool.nbytes}
    states = HostStatePool(
        StateLayout(
            num_layers=2,
            num_heads=2,
            head_k_dim=4,
            head_v_dim=4,
            conv_dim=6,
            conv_kernel=4,
            conv_dtype=torch.float32,
        ),
        num_slots=3,
        pin=True,
    )
    assert cudart.registered[states.states.data_ptr()] == states.states.nbytes
    assert cudart.registered[states.windows.data_ptr()] == states.windows.nbytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_pinned_pool_round_trips_non_blocking_copies_on_the_gpu():
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
    pool = HostPool(layout, num_pages=37, pin=True)  # not a power of two in bytes
    assert pool.kv.is_pinned()
    src = torch.randn(pool.kv.shape, device="cuda").to(torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        pool.kv.copy_(src, non_blocking=True)
        back = pool.kv.to("cuda", non_blocking=True)
    stream.synchronize()
    assert torch.equal(back, src)


def test_cpu_lists_parse_as_linux_writes_them():
    assert pinned.cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert pinned.cpu_list("5") == {5}
    assert pinned.cpu_list("\n") == set()


def test_numa_nodes_count_only_nodes_with_cpus_this_process_may_use(tmp_path, monkeypatch):
    for node, cpus in (("node0", "0-3"), ("node1", "4-7"), ("node2", "")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    monkeypatch.setattr(pinned.os, "sched_getaffinity", lambda pid: {1, 2})
    assert pinned._numa_nodes(str(tmp_path)) == 1
    monkeypatch.setattr(pinned.os, "sched_getaffinity", lambda pid: {3, 4})
    assert pinned._numa_nodes(str(tmp_path)) == 2
    assert pinned._numa_nodes(str(tmp_path / "missing")) == 1  # no node files: one node


@pytest.mark.parametrize("nodes", [1, 2])
def test_the_first_touch_runs_on_one_thread_where_the_process_spans_numa_nodes(monkeypatch, nodes):
    """Torch's intra-op threads touch the pages on one node; across nodes one thread
    does (a page lands on the node of its first toucher). The thread count is put back
    either way."""
    seen = []
    fill = torch.Tensor.fill_

    def spy(self, value):
        seen.append(torch.get_num_threads())
        return fill(self, value)

    monkeypatch.setattr(pinned, "_numa_nodes", lambda: nodes)
    monkeypatch.setattr(torch.Tensor, "fill_", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pinned._prefault(mmap.mmap(-1, 8 * mmap.PAGESIZE))
        assert seen == [2 if nodes == 1 else 1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_cpu_device_pool_reads_zero_and_is_resident_only_where_written(dtype):
    """pool_zeros on the CPU: the pool holds resident memory only for the pages written
    (torch.zeros' memset made all 64 MiB resident at once), reads zero everywhere else, at
    its shape and dtype, and a write through a view lands in the pool."""
    shape = (4, 2, 512, 16, 1024 // dtype.itemsize)  # 64 MiB
    pool = pinned.pool_zeros(shape, dtype, "cpu")
    assert pool.shape == shape and pool.dtype == dtype and pool.device.type == "cpu"
    ptr = pool.data_ptr()
    assert ptr % mmap.PAGESIZE == 0
    pool[1, 0, 3].fill_(1)  # a view's write: 16 KiB of the pool
    resident = resident_bytes(ptr)
    if resident is not None:
        assert resident <= 2**20, resident  # of 64 MiB
    assert (pool[1, 0, 3].float() == 1).all()
    assert pool.float().sum().item() == pool[1, 0, 3].numel()
