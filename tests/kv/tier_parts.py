"""What the CPU tests of the host tiers share: a small hybrid model's state-slot layout,
and a gate that holds the copy streams so a test can see what waits behind what."""

from __future__ import annotations

import threading

import torch

from batchgen.kv.state_pool import StateLayout

# three KDA layers of two heads (4-wide keys, 3-wide values), a 4-tap convolution over 6
# channels kept in bf16
STATE_LAYOUT = StateLayout(
    num_layers=3,
    num_heads=2,
    head_k_dim=4,
    head_v_dim=3,
    conv_dim=6,
    conv_kernel=4,
    conv_dtype=torch.bfloat16,
)


def block_streams(tier, streams=None) -> threading.Event:
    """Queue a task that blocks until the returned event is set on each copy stream (or
    on the next `streams` of them): copies submitted after it on that stream wait."""
    ev = threading.Event()
    for _ in range(streams or len(tier.copies._queues)):
        tier.copies.submit("gate", 0, lambda h: ev.wait(10))
    return ev
