"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight) over the latent cache.

    x ─ q_a_proj ─ q_a_layernorm ─ q_b_proj ─┐  (or q_proj alone when q_lora_rank is None)
                                              ├─ q [H, nope | rope]
    x ─ kv_a_proj_with_mqa ─┬─ c_kv ─ kv_a_layernorm ─┐
                            └─ k_pe ─ rope ───────────┴─ latent [kv_lora | rope] -> cache

Each token stores only its latent (see mla_torch for the page layout). Prefill chunks
attend over their sequence's latent decompressed through kv_b_proj; decode rows attend
absorbed: W_UK (kv_b_proj's key rows) folded into the query, W_UV applied after.
Parameter names follow transformers' DeepseekV3Attention.

FP8 pages with a checkpoint's KV scale (layers/kv_scales.py: k_scale or kv_scale, per
tensor): the latent is stored divided by it; the scale multiplies the softmax scale and
the latent output of absorbed rows, and the latents decompressed for prefill.

NoPE (Kimi Linear's MLA layers, `rotary=None`): no rotation anywhere; the "rope" part of
the query and of the latent is kept as computed, and the scale is 1/sqrt(qk head dim).

Tensor parallel (`tp`): each rank holds num_heads / size whole heads. The latent path
(q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm) is replicated, so every
rank writes the same latents into its own pool (same pages, same page tables); the
head-indexed projections are cut by heads and o_proj sums the ranks' heads:

    q_b_proj / q_proj   column-parallel   rows [H, nope + rope]  -> this rank's heads
    kv_b_proj           column-parallel   rows [H, nope + v_dim] -> its W_UK / W_UV heads
    o_proj              row-parallel      columns [H, v_dim]     -> one all-reduce
"""

from __future__ import annotations

import math

import torch
from torch import nn

from batchgen.forward_context import get_forward_context
from batchgen.kv_quant import is_fp8
from batchgen.layers import batch_invariant, mla_torch
from batchgen.layers.kv_scales import KVScales
from batchgen.layers.linear import Linear
from batchgen.layers.norm import RMSNorm
from batchgen.layers.parallel import ColumnParallelLinear, RowParallelLinear
from batchgen.layers.rotary import RotaryEmbedding, rope_parameters
from batchgen.layers.tp_group import TPGroup

# q_a_layernorm and kv_a_layernorm keep the checkpoint code's default epsilon, not
# config.rms_norm_eps (transformers and DeepSeek's reference code build them so)
LORA_NORM_EPS = 1e-6

# the attention backends MLA runs on: mla_torch, and mla_triton (imported on first use)
BACKENDS = ("torch", "triton")


def decode_split_heads(num_heads: int, dtype: torch.dtype, device: torch.device | str) -> int:
    """Programs per (request, split) of the Triton absorbed decode for `num_heads` query
    heads: what a DecodeSplitPlan counts as KV heads for an MLA model (the GQA kernel has
    one program per KV head; mla_decode one per block of query heads)."""
    from batchgen.kernels.mla_decode import default_tuning, head_blocks

    return head_blocks(num_heads, default_tuning(dtype, torch.device(device)))


def softmax_scale(config) -> float:
    """1/sqrt(qk head dim), times mscale^2 under a scaled rope with `mscale_all_dim`
    (YaRN: mscale = 0.1 * mscale_all_dim * ln(factor) + 1 for factor > 1)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    all_dim = params.get("mscale_all_dim")
    factor = params.get("factor") or 1.0
    if params["rope_type"] != "default" and all_dim and factor > 1:
        mscale = 0.1 * all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def fused_rope(x: torch.Tensor) -> bool:
    """Whether MLAttention.forward takes kernels/mla_rope.py for x's step: on CUDA, and on
    the Triton backend (the interpreter on the CPU), where its launch stores the latent."""
    return x.is_cuda or get_forward_context().attention_backend == "triton"


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rope pairs stored interleaved (x0, x1), (x2, x3), ... regrouped as [evens | odds],
    the layout the neox rotation pairs up (dimension i with i + D/2)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    """`layer_id`: the layer's index among the model's KV-cache layers (its entry in
    `ForwardContext.kv_caches`); `rotary` None: NoPE (no position encoding). With `tp`,
    this rank's share of the heads: num_heads is local."""

    def __init__(
        self,
        config,
        layer_id: int,
        rotary: RotaryEmbedding | None,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        if tp is not None:  # whole heads per rank, checked before the projections split
            self.num_heads = tp.split(self.num_heads, "num_attention_heads")
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        hidden, heads = config.hidden_size, config.num_attention_heads  # all ranks' heads
        qk_dim = self.nope_dim + self.rope_dim
        bias = bool(getattr(config, "attention_bias", False))
        q_lora_rank = getattr(config, "q_lora_rank", None)
        if q_lora_rank is None:
            self.q_proj = _by_heads(hidden, heads * qk_dim, tp)
        else:
            self.q_a_proj = Linear(hidden, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = _by_heads(q_lora_rank, heads * qk_dim, tp)
        self.q_lora = q_lora_rank is not None
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS)
        # absorb / unabsorb read its matrix (W_UK, W_UV): it stays in the model's dtype
        kv_b_out = heads * (self.nope_dim + self.v_dim)
        self.kv_b_proj = _by_heads(self.kv_lora_rank, kv_b_out, tp, quantizable=False)
        if tp is None:
            self.o_proj = Linear(heads * self.v_dim, hidden, bias=bias)
        else:
            self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias, tp=tp)
        self.rotary = rotary
        self.interleaved = bool(getattr(config, "rope_interleave", True))
        self.scale = softmax_scale(config) if rotary is not None else qk_dim**-0.5
        self.kv_scales = KVScales(1)  # the latent's: one head

    def load(self, param: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        """A checkpoint's KV-cache scale (kv_scales.split_name's "k", "v" or "kv"): the
        latent takes k_scale or kv_scale; a v_scale is checked and not used."""
        if param == "v":
            KVScales(1).load(param, tensor)
        else:
            self.kv_scales.load("k", tensor)

    def filled_by(self, param: str, tensor: torch.Tensor) -> tuple[str, ...]:
        return ()  # a scale fills no parameter: without one, 1.0

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(t, self.num_heads, -1)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], -1)
        kv = self.kv_a_proj_with_mqa(x)
        if self.rotary is not None and fused_rope(x):  # q_pe (a view of q) rotates in place
            out = self.attend_rope(q, kv, positions)
            return self.o_proj(out.reshape(t, -1))
        c_kv, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], -1)
        if self.rotary is not None:
            if self.interleaved:
                q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
            q_pe, k_pe = self.rotary(positions, q_pe, k_pe[:, None])
            k_pe = k_pe[:, 0]
        latent = torch.cat((self.kv_a_layernorm(c_kv), k_pe), dim=-1)
        return self.o_proj(self.attend(q_nope, q_pe, latent).reshape(t, -1))

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor):
        """Store the step's latents [T, W] in this layer's pages, then attend:
        q_nope [T, H, nope], q_pe [T, H, rope] (rope applied) -> [T, H, v_dim]."""
        ctx = get_forward_context()
        if ctx.before_layer is not None:
            ctx.before_layer(self.layer_id)
        (cache,) = ctx.kv_caches[self.layer_id]
        return self._store_and_attend(ctx, cache, q_nope, q_pe, latent)

    def attend_rope(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor):
        """The kernel path (kernels/mla_rope.py): q [T, H, nope + rope] (its rope slices
        rotated in place), kv_a_proj's rows kv [T, C + R] -> [T, H, v_dim]. On the Triton
        backend, unless FP8 pages take a latent scale, one launch ropes q and writes the
        latent rows into the pages; else the latent rows, then the store of `attend`."""
        from batchgen.kernels.mla_rope import mla_rope_latent, mla_rope_store

        ctx = get_forward_context()
        if ctx.before_layer is not None:
            ctx.before_layer(self.layer_id)
        (cache,) = ctx.kv_caches[self.layer_id]
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], -1)
        norm = self.kv_a_layernorm
        args = (q, kv, positions, self.rotary.cos, self.rotary.sin, norm.weight, norm.eps)
        args += (self.nope_dim, self.interleaved)
        if ctx.attention_backend != "triton" or self._latent_scale(cache) != 1.0:
            return self._store_and_attend(ctx, cache, q_nope, q_pe, mla_rope_latent(*args))
        mla_rope_store(*args, cache, ctx.metadata.slot_mapping)
        if ctx.on_kv_written is not None:
            ctx.on_kv_written(self.layer_id)
        return self._attend_pages(ctx, cache, q_nope, q_pe, 1.0)

    def _latent_scale(self, cache: torch.Tensor) -> float:
        """The checkpoint's latent scale, on FP8 pages only (s q.c' = q.c, s p.c' = p.c)."""
        return self.kv_scales.k_shared if is_fp8(cache.dtype) else 1.0

    def _store_and_attend(self, ctx, cache, q_nope, q_pe, latent) -> torch.Tensor:
        """The latents stored (divided by the scale), on_kv_written, attention. The
        caller has called before_layer."""
        s = self._latent_scale(cache)
        if s != 1.0:
            latent = latent.float() / s
        _backend(ctx.attention_backend).store_latent(cache, latent, ctx.metadata.slot_mapping)
        if ctx.on_kv_written is not None:
            ctx.on_kv_written(self.layer_id)
        return self._attend_pages(ctx, cache, q_nope, q_pe, s)

    def _attend_pages(self, ctx, cache, q_nope, q_pe, s: float) -> torch.Tensor:
        """Attention of the step's rows over the layer's pages, the step's latents in
        them; s: the latent scale they were stored divided by."""
        meta = ctx.metadata
        backend = _backend(ctx.attention_backend)
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
        if meta.decode_rows is not None and meta.decode_rows.numel() > 0:
            rows = meta.decode_rows
            o_latent = backend.paged_decode(
                self.absorb(q_nope[rows]), q_pe[rows], cache, meta, self.scale * s
            )
            out[rows] = self.unabsorb(o_latent if s == 1.0 else o_latent * s).to(out.dtype)
        if meta.prefills and batch_invariant.active():  # every row absorbed, as decode's
            # in the dtype the backend's decode returns (torch: float32), so both round alike
            dtype = torch.float32 if backend is mla_torch else q_nope.dtype
            o_latent = q_nope.new_zeros(
                q_nope.shape[0], self.num_heads, self.kv_lora_rank, dtype=dtype
            )
            backend.paged_prefill_absorbed(
                self.absorb(q_nope), q_pe, cache, meta, self.scale * s, o_latent
            )
            o = self.unabsorb(o_latent if s == 1.0 else o_latent * s).to(out.dtype)
            for seq in meta.prefills:
                rows = slice(seq.q_start, seq.q_start + seq.q_len)
                out[rows] = o[rows]
        elif meta.prefills:
            expand = self.expand if s == 1.0 else lambda cached: self.expand(cached * s)
            backend.paged_prefill(q_nope, q_pe, cache, meta, expand, self.scale, out)
        return out

    def _w_kv_b(self) -> torch.Tensor:
        """kv_b_proj's weight per head: [H, nope + v_dim, kv_lora_rank] (W_UK rows first)."""
        return self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [B, H, nope] -> q_nope W_UK [B, H, kv_lora_rank]: scores against c_kv
        equal scores of q_nope against the decompressed keys' nope part."""
        w_uk = self._w_kv_b()[:, : self.nope_dim]
        if batch_invariant.active():  # rows in tiles: a row's bits whatever the batch
            return batch_invariant.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        return torch.einsum("bhn,hnc->bhc", q_nope, w_uk)

    def unabsorb(self, o_latent: torch.Tensor) -> torch.Tensor:
        """Attention output over c_kv [B, H, kv_lora_rank] -> through W_UV [B, H, v_dim]."""
        w_uv = self._w_kv_b()[:, self.nope_dim :]
        w_uv = w_uv.to(o_latent.dtype)
        if batch_invariant.active():
            return batch_invariant.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(
                0, 1
            )
        return torch.einsum("bhc,hvc->bhv", o_latent, w_uv)

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decompress latents [S, W] into the keys' nope part [S, H, nope], their rope part
        k_pe [S, rope] (one for every head) and V [S, H, v_dim]: views, nothing joined."""
        s = latent.shape[0]
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c_kv).view(s, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        return k_nope, k_pe, v


def _by_heads(
    in_features: int, out_features: int, tp: TPGroup | None, quantizable: bool = True
) -> Linear:
    """A projection whose output rows are per head: split by heads under `tp`."""
    if tp is None:
        return Linear(in_features, out_features, quantizable=quantizable)
    return ColumnParallelLinear(in_features, out_features, tp=tp, quantizable=quantizable)


def _backend(name: str):
    if name == "torch":
        return mla_torch
    if name == "triton":
        from batchgen.layers import mla_triton

        return mla_triton
    raise ValueError(f"MLA attention has no {name!r} backend (it runs on {', '.join(BACKENDS)})")
