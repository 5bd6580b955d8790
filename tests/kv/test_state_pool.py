"""The compressed-state pool of linear-attention layers: slot tensors and slot bookkeeping."""

from __future__ import annotations

import pytest
import torch

from batchgen.kv.state_pool import StateLayout, StatePool, StateSlots


def layout(**overrides) -> StateLayout:
    fields = dict(
        num_layers=3,
        num_heads=2,
        head_k_dim=8,
        head_v_dim=4,
        conv_dim=48,
        conv_kernel=4,
        conv_dtype=torch.bfloat16,
    )
    return StateLayout(**{**fields, **overrides})


def test_layout_bytes_per_slot():
    lay = layout()
    state = 2 * 8 * 4 * 4  # float32 whatever the model dtype
    window = 3 * 48 * 2  # K - 1 rows of bfloat16
    assert lay.bytes_per_slot == 3 * (state + window)


def test_pool_shapes_and_layer_views():
    lay = layout()
    pool = StatePool(lay, num_slots=5, device="cpu")
    # value-major per head: [H, Dv, Dk]
    assert pool.states.shape == (3, 5, 2, 4, 8) and pool.states.dtype == torch.float32
    assert pool.windows.shape == (3, 5, 3, 48) and pool.windows.dtype == torch.bfloat16
    assert pool.nbytes == 5 * lay.bytes_per_slot
    views = pool.layer_states()
    assert len(views) == 3
    states, windows = views[1]
    states[4].fill_(2.0)
    windows[0].fill_(1.0)
    assert pool.states[1, 4].eq(2.0).all() and pool.states[0].eq(0).all()
    assert pool.windows[1, 0].eq(1.0).all() and pool.windows[2].eq(0).all()


def test_pool_needs_a_slot():
    with pytest.raises(ValueError):
        StatePool(layout(), num_slots=0, device="cpu")


def test_slots_take_release_reuse():
    slots = StateSlots(3)
    assert [slots.take(r) for r in ("a", "b", "c")] == [0, 1, 2]
    assert slots.num_free == 0 and slots.holds("b") and slots.slot("b") == 1
    with pytest.raises(RuntimeError):
        slots.take("d")
    slots.release("b")
    slots.release("b")  # releasing twice is harmless
    assert slots.num_free == 1 and not slots.holds("b")
    assert slots.take("d") == 1
    with pytest.raises(RuntimeError):
        slots.take("d")
    with pytest.raises(KeyError):
        slots.slot("b")
