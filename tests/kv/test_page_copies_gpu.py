"""The tier's copy bodies and its gather make the host wait for no stream.

A store is gathered on the compute stream while the step before it may still run there,
and a load is queued on a copy stream behind other copies: a blocking read (`.item()`,
`.tolist()` or `.cpu()` of a device tensor) in either would stall the host behind that
work. torch's sync debug mode reports such a wait as an error; each copy runs under it
with work queued ahead, then its data is checked. (Index uploads from pageable memory,
which CUDA may also stage synchronously, are not reported by that mode; the hygiene
check's pageable-upload rule covers them.)"""

from __future__ import annotations

import pytest
import torch

from batchgen.kv.page_copies import (
    device_to_host_pages,
    device_to_host_staged,
    device_to_host_state,
    gather_pages,
    host_to_device_pages,
    host_to_device_state,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]

L, P, PH, S, H, D = 4, 32, 48, 16, 2, 64


class NoHostWait:
    """Inside: any torch operation that makes the host wait for the device raises."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


def busy_stream():
    """Queue about a millisecond of work on the current stream, so a copy queued behind it
    has something to wait for."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):
        a = a @ a
        a = a / a.norm()
    return a


def test_a_blocking_read_is_caught():
    """The check can fail: a gather that read its index back to the host is reported."""
    dev = torch.randn(L, 2, P, S, H, D, device="cuda")
    with NoHostWait():
        staged = gather_pages(dev, [1, 2], [0, 1])
        with pytest.raises(RuntimeError, match="synchroniz"):
            staged.sum().item()


def test_store_and_load_of_pages_wait_for_no_stream():
    dev = torch.randn(L, 2, P, S, H, D, device="cuda", dtype=torch.bfloat16)
    host = torch.zeros(L, PH, 2, S, H, D, dtype=torch.bfloat16, pin_memory=True)
    dev_pages, host_pages = [3, 7, 8, 20, 31], [40, 41, 5, 6, 7]
    more_dev, more_host = [0, 1], [30, 12]
    back = torch.zeros_like(dev)
    with NoHostWait():
        busy_stream()
        staged = gather_pages(dev, dev_pages, host_pages)
        keep = device_to_host_staged(staged, host, host_pages)
        keep2 = device_to_host_pages(dev, host, more_dev, more_host)
        busy_stream()
        keep3 = host_to_device_pages(host, back, host_pages + more_host, dev_pages + more_dev)
    assert keep and keep2 and keep3
    for d, h in zip(dev_pages + more_dev, host_pages + more_host):
        assert torch.equal(host[:, h], dev[:, :, d].cpu())
        assert torch.equal(back[:, :, d], dev[:, :, d])


def test_store_and_load_of_state_slots_wait_for_no_stream():
    states = torch.randn(L, 6, H, D, D, device="cuda")
    windows = torch.randn(L, 6, 3, 128, device="cuda", dtype=torch.bfloat16)
    host = (
        torch.zeros(L, 9, H, D, D, pin_memory=True),
        torch.zeros(L, 9, 3, 128, dtype=torch.bfloat16, pin_memory=True),
    )
    back = (torch.zeros_like(states), torch.zeros_like(windows))
    dev_slots, host_slots = [4, 1, 2], [8, 0, 1]
    with NoHostWait():
        busy_stream()
        keep = device_to_host_state((states, windows), host, dev_slots, host_slots)
        busy_stream()
        keep2 = host_to_device_state(host, back, host_slots, dev_slots)
    assert keep and keep2
    for d, h in zip(dev_slots, host_slots):
        assert torch.equal(host[0][:, h], states[:, d].cpu())
        assert torch.equal(host[1][:, h], windows[:, d].cpu())
        assert torch.equal(back[0][:, d], states[:, d])
        assert torch.equal(back[1][:, d], windows[:, d])
