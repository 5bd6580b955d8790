"""Repetition, frequency and presence penalties in one pass over the logits.

For each row b and token j, with c = its count among the row's output tokens and
seen = c > 0 or j in the row's prompt:

    x = x / rep if x > 0 else x * rep        (rep where seen, else 1)
    x = x - frequency * c
    x = x - presence * (c > 0)

exactly as the torch reference computes it op by op (float32, an IEEE division, the
product frequency * c rounded before the subtraction: libdevice's mul_rn on CUDA, so
no FMA contraction changes a bit). The torch formula made ~12 [rows, V] temporaries a
step; the kernel reads the logits, counts and prompt mask once and writes the result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_BLOCK = 2048


@triton.jit
def _mul_rn(a, b, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.mul_rn(a, b)
    return a * b


@triton.jit
def _penalty_kernel(
    logits_ptr, counts_ptr, prompt_ptr, rows_ptr, rep_ptr, freq_ptr, pres_ptr, out_ptr,
    stride_x, stride_c, stride_p, VOCAB,
    HAS_PROMPT: tl.constexpr, HAS_ROWS: tl.constexpr, LIBDEVICE: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < VOCAB
    src = row
    if HAS_ROWS:
        src = tl.load(rows_ptr + row)
    x = tl.load(logits_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(counts_ptr + src * stride_c + cols, mask=mask, other=0)
    out_seen = c > 0
    seen = out_seen
    if HAS_PROMPT:
        seen = seen | (tl.load(prompt_ptr + src * stride_p + cols, mask=mask, other=0) != 0)
    rep = tl.where(seen, tl.load(rep_ptr + row), 1.0)
    x = tl.where(x > 0, tl.math.div_rn(x, rep), x * rep)
    x = x - _mul_rn(tl.load(freq_ptr + row), c.to(tl.float32), LIBDEVICE)
    x = x - _mul_rn(tl.load(pres_ptr + row), out_seen.to(tl.float32), LIBDEVICE)
    tl.store(out_ptr + row * VOCAB + cols, x, mask=mask)


def _check(logits, counts, prompt_mask, repetition, frequency, presence, rows) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be float [B, V] with contiguous rows: {list(logits.shape)}")
    n, vocab = logits.shape
    if rows is not None and (rows.shape != (n,) or rows.dtype != torch.int64):
        raise ValueError(f"rows must be [{n}] int64: {list(rows.shape)} {rows.dtype}")
    for name, t, dtype in (
        ("counts", counts, torch.int32),
        ("prompt_mask", prompt_mask, torch.bool),
    ):
        if t is None:
            continue
        shape_ok = t.dim() == 2 and t.shape[1] == vocab and (rows is not None or t.shape[0] == n)
        if not shape_ok or t.dtype != dtype or t.stride(1) != 1:
            raise ValueError(f"{name} must be {dtype} [B or slots, V]: {list(t.shape)} {t.dtype}")
    for name, t in (("repetition", repetition), ("frequency", frequency), ("presence", presence)):
        if t.shape != (n,) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [{n}] float32: {list(t.shape)}")


def penalized_logits(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, V] (any float dtype, rows contiguous), counts [B, V] int32 (each row's
    output-token counts), prompt_mask [B, V] bool or None, the three penalties [B]
    float32 -> new float32 logits [B, V] with the penalties applied (the module's
    formula); with rows [B] int64, counts and prompt_mask are [slots, V] and row b reads
    slot rows[b] (kept counts, not gathered). The inputs are not modified, nothing is
    read back to the host."""
    _check(logits, counts, prompt_mask, repetition, frequency, presence, rows)
    n, vocab = logits.shape
    out = torch.empty((n, vocab), dtype=torch.float32, device=logits.device)
    if n and vocab:
        block = min(_BLOCK, triton.next_power_of_2(vocab))
        prompt = counts if prompt_mask is None else prompt_mask
        _penalty_kernel[(n, triton.cdiv(vocab, block))](
            logits, counts, prompt, counts if rows is None else rows, repetition, frequency,
            presence, out, logits.stride(0), counts.stride(0), prompt.stride(0), vocab,
            HAS_PROMPT=prompt_mask is not None, HAS_ROWS=rows is not None,
            LIBDEVICE=logits.device.type == "cuda", BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out


def penalized_logits_reference(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    repetition: torch.Tensor,
    frequency: torch.Tensor | None,
    presence: torch.Tensor | None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same in torch, op by op (a penalty given as None is not applied)."""
    if rows is not None:
        counts = counts.index_select(0, rows)
        prompt_mask = None if prompt_mask is None else prompt_mask.index_select(0, rows)
    logits = logits.float()
    seen = counts > 0
    if prompt_mask is not None:
        seen = seen | prompt_mask
    rep = torch.where(seen, repetition.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    if frequency is not None:
        logits = logits - frequency.unsqueeze(1) * counts
    if presence is not None:
        logits = logits - presence.unsqueeze(1) * (counts > 0)
    return logits
