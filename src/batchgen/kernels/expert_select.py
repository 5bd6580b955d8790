"""A MoE router's expert choice in one Triton program per block of tokens.

    s = sigmoid(u)  (softmax(u) with scoring "softmax")     u: the router's float32 logits
    c = s + b       b: e_score_correction_bias (choosing only)
    ids = the top_k experts by c, best first;  w = s[ids] / sum(s[ids]) (when renormalising)
    weights = routed_scaling_factor * w

layers/moe_routing.select_experts computes the same with torch ops: a sigmoid, an add, a
top-k, a gather, a sum, a division and a scaling, each a kernel and a pass over [T, E]
or [T, top_k] (W6's top-k alone took 117 us a layer in a 32,768-token step on an H200).
Here each program loads its tokens' logits once and keeps everything in registers; the
top_k experts are taken one by one (the leftmost of equal scores first), so the columns
come in torch.topk's order. No group limit (n_group 1, or every group kept): callers
take the torch path for configs with one.

The sigmoid is computed as torch's CUDA kernel computes it, 1 / (1 + exp(-u)) with
libdevice's expf and IEEE division, so the scores match torch's bit for bit on the GPU;
the weights' sum may add in another order (a last-bit difference). In Triton's
interpreter (the CPU) exp is numpy's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.rounding import exp_as_torch, libdevice_exp

_TILE = 2048  # logits a program holds: BLOCK_T tokens x BLOCK_E experts


@triton.jit
def _expert_select_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, stride_logits, scale,
    E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    col_ok = cols < E
    at = logits_ptr + rows[:, None] * stride_logits + cols[None, :]
    u = tl.load(at, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    if SOFTMAX:
        u = tl.where(col_ok[None, :], u, float("-inf"))
        e = exp_as_torch(u - tl.max(u, axis=1)[:, None], LIBDEVICE_EXP)
        s = tl.math.div_rn(e, tl.sum(e, axis=1)[:, None])
    else:
        e = exp_as_torch(-u, LIBDEVICE_EXP)
        s = tl.math.div_rn(tl.full(u.shape, 1.0, tl.float32), 1.0 + e)
    c = s
    if HAS_BIAS:
        c = s + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    c = tl.where(col_ok[None, :], c, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    w_all = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    id_all = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(c, axis=1, tie_break_left=True)
        hit = cols[None, :] == best[:, None]
        w = tl.sum(tl.where(hit, s, 0.0), axis=1)
        total += w
        w_all = tl.where(slots[None, :] == j, w[:, None], w_all)
        id_all = tl.where(slots[None, :] == j, best[:, None], id_all)
        c = tl.where(hit, float("-inf"), c)
    if RENORMALIZE:
        w_all = tl.math.div_rn(w_all, total[:, None])
    w_all = w_all * scale
    out_ok = row_ok[:, None] & (slots[None, :] < TOP_K)
    out_at = rows[:, None] * TOP_K + slots[None, :]
    tl.store(weights_ptr + out_at, w_all, mask=out_ok)
    tl.store(ids_ptr + out_at, id_all.to(tl.int64), mask=out_ok)


def expert_select(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    *,
    scoring: str = "sigmoid",
    renormalize: bool = True,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] float32 (rows may be strided, contiguous within a row), bias
    [E] float32 or None -> (weights [T, top_k] float32, ids [T, top_k] int64), best first."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(
            f"logits must be [T, E] float32 with contiguous rows: {list(logits.shape)} "
            f"{logits.dtype} strides {logits.stride()}"
        )
    tokens, experts = logits.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be in 1..{experts}")
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring must be 'sigmoid' or 'softmax', got {scoring!r}")
    if bias is not None and (
        bias.shape != (experts,) or bias.dtype != torch.float32 or bias.device != logits.device
    ):
        raise ValueError(f"bias must be [{experts}] float32 on {logits.device}")
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens:
        block_e = triton.next_power_of_2(experts)
        block_t = max(1, _TILE // block_e)
        bias_arg = logits if bias is None else bias.contiguous()  # never read without bias
        _expert_select_kernel[(triton.cdiv(tokens, block_t),)](
            logits, bias_arg, weights, ids, tokens, logits.stride(0), float(scale),
            E=experts, TOP_K=top_k, BLOCK_T=block_t, BLOCK_E=block_e,
            BLOCK_K=triton.next_power_of_2(top_k), SOFTMAX=scoring == "softmax",
            HAS_BIAS=bias is not None, RENORMALIZE=renormalize,
            LIBDEVICE_EXP=libdevice_exp(logits), num_warps=4,
        )  # fmt: skip
    return weights, ids
