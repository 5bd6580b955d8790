"""MLA attention over the latent paged cache: the absorbed decode equals the decompressed
prefill on the same cache, chunked prefill equals one chunk, and the latent written is
kv_norm(c_kv) then the rope'd k_pe."""

from __future__ import annotations

import math

import pytest
import torch

from batchgen.forward_context import (
    AttentionMetadata,
    ForwardContext,
    PrefillSeq,
    bind_forward_context,
)
from batchgen.layers.mla import MLAttention, deinterleave, softmax_scale
from batchgen.layers.rotary import RotaryEmbedding

PAGE = 4
HIDDEN = 48
POISON = 1e3  # what a slot no token wrote holds: any read of it shows


def _config(q_lora_rank=24, rope_scaling=None):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=64,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        qk_nope_head_dim=12,
        v_head_dim=10,
        num_hidden_layers=1,
        max_position_embeddings=256,
        rope_scaling=rope_scaling,
    )


def _layer(config, seed=0):
    torch.manual_seed(seed)
    attn = MLAttention(config, 0, RotaryEmbedding(config, config.qk_rope_head_dim, 256))
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape) * (0.2 if p.dim() == 2 else 1.0) + (p.dim() == 1))
    return attn


def _cache(config, num_pages=16):
    width = config.kv_lora_rank + config.qk_rope_head_dim
    return torch.full((num_pages, PAGE, 1, width), POISON)  # unwritten slots


def _slots(pages, positions):
    return torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in positions])


def _run(attn, cache, x, positions, meta):
    ctx = ForwardContext(meta, [(cache,)])
    with torch.no_grad(), bind_forward_context(ctx):
        return attn(positions, x)


def _prefill(attn, cache, x, pages, start):
    """x [n, hidden] at positions start.. of a sequence whose first `start` are cached."""
    n = x.shape[0]
    positions = torch.arange(start, start + n)
    seq = PrefillSeq(0, n, start + n, torch.tensor(pages[: math.ceil((start + n) / PAGE)]))
    meta = AttentionMetadata(n, _slots(pages, positions.tolist()), prefills=[seq])
    return _run(attn, cache, x, positions, meta)


def _decode(attn, cache, x, pages_per_row, positions):
    """One token per row [B, hidden]; row i at positions[i] with pages_per_row[i]."""
    width = max(len(p) for p in pages_per_row)
    table = torch.tensor([p + [0] * (width - len(p)) for p in pages_per_row])
    seq_lens = torch.tensor(positions) + 1
    slots = torch.cat([_slots(p, [pos]) for p, pos in zip(pages_per_row, positions)])
    meta = AttentionMetadata(
        len(positions),
        slots,
        decode_rows=torch.arange(len(positions)),
        decode_page_table=table,
        decode_seq_lens=seq_lens,
        decode_max_seq_len=int(seq_lens.max()),
    )
    return _run(attn, cache, x, torch.tensor(positions), meta)


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q_lora", "plain_q"])
def test_absorbed_decode_equals_decompressed_prefill(q_lora_rank):
    config = _config(q_lora_rank)
    attn = _layer(config)
    lengths = [13, 6, 1]
    pages = [[3, 9, 1, 12], [0, 7], [5]]  # scattered, as the allocator hands them out
    xs = [torch.randn(n, HIDDEN) for n in lengths]
    cache = _cache(config)
    prefilled = [_prefill(attn, cache, x, p, 0) for x, p in zip(xs, pages)]
    last = torch.stack([x[-1] for x in xs])
    decoded = _decode(attn, cache, last, pages, [n - 1 for n in lengths])
    for i, out in enumerate(prefilled):
        torch.testing.assert_close(decoded[i], out[-1], atol=1e-5, rtol=1e-5)
    # and not by accident: a different cache gives a different decode
    cache[3, 1] += 1.0
    assert not torch.allclose(_decode(attn, cache, last, pages, [12, 5, 0])[0], decoded[0])


def test_chunked_prefill_equals_one_chunk():
    config = _config(rope_scaling=_yarn())
    attn = _layer(config, seed=1)
    x = torch.randn(11, HIDDEN)
    pages = [2, 6, 4]
    whole = _prefill(attn, _cache(config), x, pages, 0)
    cache = _cache(config)
    first = _prefill(attn, cache, x[:5], pages, 0)
    second = _prefill(attn, cache, x[5:], pages, 5)
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-5, rtol=1e-5)


def test_the_latent_written_is_normed_c_kv_then_rope_k_pe():
    config = _config()
    attn = _layer(config)
    x = torch.randn(3, HIDDEN)
    cache = _cache(config)
    _prefill(attn, cache, x, [1], 0)
    c_kv, k_pe = attn.kv_a_proj_with_mqa(x).split([16, 8], dim=-1)
    _, k_rot = attn.rotary(torch.arange(3), torch.zeros(3, 1, 8), deinterleave(k_pe)[:, None])
    with torch.no_grad():
        want = torch.cat([attn.kv_a_layernorm(c_kv), k_rot[:, 0]], dim=-1)
    torch.testing.assert_close(cache[1, :3, 0], want)
    assert cache[1, 3].eq(POISON).all() and cache[0].eq(POISON).all()  # nothing else written


def _yarn():
    return {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }


def test_softmax_scale_takes_yarn_mscale_squared():
    assert softmax_scale(_config()) == pytest.approx(20**-0.5)
    mscale = 0.1 * math.log(4.0) + 1.0
    assert softmax_scale(_config(rope_scaling=_yarn())) == pytest.approx(20**-0.5 * mscale**2)
    no_all_dim = {k: v for k, v in _yarn().items() if k != "mscale_all_dim"}
    assert softmax_scale(_config(rope_scaling=no_all_dim)) == pytest.approx(20**-0.5)


def test_paged_decode_has_the_decode_kernels_semantics():
    """mla_torch.paged_decode against kernels.mla_decode's reference, which the Triton
    kernel that is to replace it is tested against."""
    from kernel_references import mla_decode_reference

    from batchgen.layers import mla_torch

    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(10, PAGE, 1, 16 + 8, generator=gen)
    table = torch.tensor([[4, 1, 7, 0], [2, 9, 0, 0], [5, 0, 0, 0]])
    seq_lens = torch.tensor([14, 5, 1])
    q_nope, q_pe = torch.randn(3, 4, 16, generator=gen), torch.randn(3, 4, 8, generator=gen)
    meta = AttentionMetadata(
        3,
        torch.zeros(3, dtype=torch.int64),
        decode_rows=torch.arange(3),
        decode_page_table=table,
        decode_seq_lens=seq_lens,
        decode_max_seq_len=14,
    )
    ours = mla_torch.paged_decode(q_nope, q_pe, cache, meta, 0.3)
    ref = mla_decode_reference(q_nope, q_pe, cache, table, seq_lens, 0.3)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
