"""Compressed-state slots cross between the device and host pools like pages: in blocks
of consecutive host slots, in host-slot order, states and conv windows together."""

from __future__ import annotations

import torch
from tier_parts import STATE_LAYOUT

from batchgen.kv.copy_engine import CopyEngine
from batchgen.kv.page_copies import device_to_host_state, host_to_device_state
from batchgen.kv.state_pool import HostStatePool, StatePool


def filled_pool(num_slots: int = 6) -> StatePool:
    pool = StatePool(STATE_LAYOUT, num_slots, "cpu")
    pool.states.copy_(torch.arange(pool.states.numel(), dtype=torch.float32).view_as(pool.states))
    pool.windows.copy_(torch.randn(pool.windows.shape))
    return pool


def test_slots_round_trip_in_host_slot_order(monkeypatch):
    pool, host = filled_pool(), HostStatePool(STATE_LAYOUT, 8, pin=False)
    blocks = []
    real = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        if self.dim() == src.dim() == 4 and self.dtype == torch.float32:  # state blocks
            blocks.append(self.shape[0])
        return real(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    dev_slots, host_slots = [1, 4, 5], [7, 6, 5]  # host ids run down: still one block
    device_to_host_state(
        (pool.states, pool.windows), (host.states, host.windows), dev_slots, host_slots
    )
    assert blocks == [3] * STATE_LAYOUT.num_layers
    for d, h in zip(dev_slots, host_slots):
        assert torch.equal(host.states[:, h], pool.states[:, d])
        assert torch.equal(host.windows[:, h], pool.windows[:, d])
    back = StatePool(STATE_LAYOUT, 6, "cpu")
    host_to_device_state(
        (host.states, host.windows), (back.states, back.windows), host_slots, [0, 2, 3]
    )
    for d, src in zip([0, 2, 3], dev_slots):
        assert torch.equal(back.states[:, d], pool.states[:, src])
        assert torch.equal(back.windows[:, d], pool.windows[:, src])
    for untouched in (1, 4, 5):  # nothing else written
        assert back.states[:, untouched].abs().sum() == 0
        assert back.windows[:, untouched].abs().sum() == 0


def test_slot_copies_run_through_the_copy_engine():
    pool, host = filled_pool(), HostStatePool(STATE_LAYOUT, 4, pin=False)
    copies = CopyEngine(torch.device("cpu"))
    try:
        out = copies.submit(
            "swap_out",
            STATE_LAYOUT.bytes_per_slot,
            lambda h: device_to_host_state(
                (pool.states, pool.windows), (host.states, host.windows), [2], [0]
            ),
        )
        out.synchronize()
        restored = StatePool(STATE_LAYOUT, 6, "cpu")
        back = copies.submit(
            "swap_in",
            STATE_LAYOUT.bytes_per_slot,
            lambda h: host_to_device_state(
                (host.states, host.windows), (restored.states, restored.windows), [0], [5]
            ),
        )
        back.synchronize()
    finally:
        copies.close()
    assert torch.equal(restored.states[:, 5], pool.states[:, 2])
    assert torch.equal(restored.windows[:, 5], pool.windows[:, 2])
