"""What the CPU tests of the host tiers share: a small hybrid model's state-slot layout
and a state tier over it, and a gate that holds the copy streams so a test can see what
waits behind what."""

from __future__ import annotations

import threading

import torch

from batchgen.kv.copy_engine import CopyEngine
from batchgen.kv.state_pool import HostStatePool, StateLayout, StatePool, StateSlots
from batchgen.kv.state_tier import StateTier
from batchgen.kv.tier_metrics import TierMetrics

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


def make_state_tier(dev_slots=3, host_slots=2, debug=False, load_scatter="copy", mirror=None):
    """A StateTier on the CPU over STATE_LAYOUT, its own copy engine: device slots random,
    host slots -1 (a slot nothing wrote reads -1); returns it and its device slots."""
    pool = StatePool(STATE_LAYOUT, dev_slots, "cpu")
    pool.states.normal_()
    pool.windows.normal_()
    host = HostStatePool(STATE_LAYOUT, host_slots, pin=False)
    host.states.fill_(-1.0)
    host.windows.fill_(-1.0)
    slots = StateSlots(dev_slots)
    copies = CopyEngine(torch.device("cpu"))
    tier = StateTier(
        pool, host, slots, copies, TierMetrics(), debug, load_scatter=load_scatter, mirror=mirror
    )
    return tier, slots


def block_streams(tier, streams=None) -> threading.Event:
    """Queue a task that blocks until the returned event is set on each copy stream (or
    on the next `streams` of them): copies submitted after it on that stream wait."""
    ev = threading.Event()
    for _ in range(streams or len(tier.copies._queues)):
        tier.copies.submit("gate", 0, lambda h: ev.wait(10))
    return ev
