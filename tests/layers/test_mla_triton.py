"""MLA on the Triton backend (layers/mla_triton.py) against the torch reference, one
layer, one mixed step: two prefill chunks (one after a cached prefix) and two decode rows
in the same packed batch, plus a padding row (slot -1) as a graph batch has. Under the
interpreter on the CPU, compiled on a GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_mla import HIDDEN, PAGE, POISON, _config, _layer, _slots

from batchgen.forward_context import (
    AttentionMetadata,
    ForwardContext,
    PrefillSeq,
    bind_forward_context,
)
from batchgen.kv_quant import FP8, FP8_MAX, to_cache

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _mixed_step():
    """Packed rows: | prefill A (5, fresh) | decode B | prefill C (4, after 6 cached) |
    decode D | padding |. Returns (positions, metadata, the cached positions per seq)."""
    pages = {"A": [3, 9], "B": [0, 7, 11], "C": [5, 2, 14], "D": [6]}
    rows = [("A", range(0, 5)), ("B", [9]), ("C", range(6, 10)), ("D", [2])]
    positions, slots = [], []
    for name, span in rows:
        positions += list(span)
        slots += _slots(pages[name], list(span)).tolist()
    positions.append(0)
    slots.append(-1)  # a padding row writes nothing
    dev = dict(device=DEVICE)
    meta = AttentionMetadata(
        len(positions),
        torch.tensor(slots, **dev),
        decode_rows=torch.tensor([5, 10], **dev),
        decode_page_table=torch.tensor([pages["B"], pages["D"] + [0, 0]], **dev),
        decode_seq_lens=torch.tensor([10, 3], **dev),
        decode_max_seq_len=10,
        prefills=[
            PrefillSeq(0, 5, 5, torch.tensor(pages["A"], **dev)),
            PrefillSeq(6, 4, 10, torch.tensor(pages["C"], **dev)),
        ],
    )
    # tokens before this step: B's 0..8, C's 0..5, D's 0..1
    cached = {"B": range(0, 9), "C": range(0, 6), "D": range(0, 2)}
    return torch.tensor(positions, **dev), meta, {n: (pages[n], list(s)) for n, s in cached.items()}


def _mixed_case(dtype):
    """The MLA layer in `dtype` and _mixed_step's positions and hidden states; a cache of
    16 pages reading POISON but for the earlier steps' latents; the step's metadata, and
    the torch reference's (it writes every slot: its padding row goes to page 15,
    unused)."""
    config = _config()
    attn = _layer(config).to(DEVICE, dtype)
    attn.rotary.materialize(DEVICE)  # its tables are not module buffers
    width = config.kv_lora_rank + config.qk_rope_head_dim
    positions, meta, cached = _mixed_step()
    gen = torch.Generator().manual_seed(2)
    cache = torch.full((16, PAGE, 1, width), POISON, dtype=dtype, device=DEVICE)
    for pages, span in cached.values():  # earlier steps' latents
        slots = _slots(pages, span).to(DEVICE)
        cache.view(-1, width)[slots] = torch.randn(len(span), width, generator=gen).to(cache)
    x = torch.randn(meta.num_tokens, HIDDEN, generator=gen).to(DEVICE, dtype)
    ref_meta = replace(meta, slot_mapping=meta.slot_mapping.clone())
    ref_meta.slot_mapping[-1] = 15 * PAGE
    return attn, positions, x, cache, meta, ref_meta


def _kernel_rope_on_both_backends(monkeypatch):
    """The torch backend's run takes kernels/mla_rope.py too (as on CUDA), so that its
    pages hold the bits the Triton backend's one launch (mla_rope_store) must write; the
    Triton backend's own store_latent refuses to run."""
    from batchgen.layers import mla, mla_triton

    def no_store(*args):
        raise AssertionError("the Triton backend stored the latent apart from the rope")

    monkeypatch.setattr(mla, "fused_rope", lambda x: True)
    monkeypatch.setattr(mla_triton, "store_latent", no_store)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_matches_torch_backend(monkeypatch, dtype):
    _kernel_rope_on_both_backends(monkeypatch)
    attn, positions, x, cache, meta, ref_meta = _mixed_case(dtype)
    outs, caches = {}, {}
    for backend, m in (("torch", ref_meta), ("triton", meta)):
        caches[backend] = cache.clone()
        ctx = ForwardContext(m, [(caches[backend],)], backend)
        with torch.no_grad(), bind_forward_context(ctx):
            outs[backend] = attn(positions, x)[:-1].float()  # the padding row is ignored
    assert (caches["triton"][15] == POISON).all(), "the padding row wrote its latent"
    torch.testing.assert_close(caches["triton"][:15], caches["torch"][:15], atol=0, rtol=0)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_on_an_fp8_latent_matches_torch_backend(monkeypatch, dtype):
    """The same step over FP8 latent pages (kv_cache_dtype "fp8"): both backends store
    the same bytes and attend alike; the outputs stay within FP8's rounding of the
    step over pages in the compute dtype."""
    _kernel_rope_on_both_backends(monkeypatch)
    attn, positions, x, cache, meta, ref_meta = _mixed_case(dtype)
    outs, caches = {}, {}
    runs = (("torch", ref_meta, FP8), ("triton", meta, FP8), ("compute", ref_meta, dtype))
    for name, m, kv_dtype in runs:
        caches[name] = to_cache(cache, kv_dtype)
        backend = "torch" if name == "compute" else name
        ctx = ForwardContext(m, [(caches[name],)], backend)
        with torch.no_grad(), bind_forward_context(ctx):
            outs[name] = attn(positions, x)[:-1].float()
    assert caches["triton"].dtype == FP8
    assert (caches["triton"][15].float() == FP8_MAX).all(), "the padding row wrote"
    raw = {k: caches[k][:15].view(torch.uint8) for k in ("torch", "triton")}
    assert torch.equal(raw["triton"], raw["torch"])
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=tol, rtol=tol)
    err = (outs["torch"] - outs["compute"]).abs().max().item()
    assert err < 0.1 * outs["compute"].abs().max().item(), err
