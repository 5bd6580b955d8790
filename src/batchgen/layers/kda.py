"""Kimi Delta Attention, the linear-attention layer of Kimi Linear and Kimi-K3.

    x ──in_proj──> q k v | b | f_a | g_a          (one GEMM: the checkpoint's q_proj, k_proj,
                                                  v_proj, b_proj, f_a_proj and g_a_proj)
    q k v ──conv1d (causal, K taps, SiLU; per-request window) ──> q | k | v
    f_a ──f_b_proj──> -exp(A_log) * softplus(. + dt_bias) = g   (log decay per key dim)
    b ──sigmoid──> beta
    q, k, v, g, beta, state[slot] ──KDA (kda_ops)──> o        state[slot] moves on
    o ──o_norm (RMSNorm per head, * sigmoid(g_b_proj(g_a)))──o_proj──> out

The six projections of x are stacked into one weight: x is read once, and a decode step
runs one GEMM where it ran four (three of them 16 to 128 columns wide, each about as slow
as the wide one at a decode batch).

No per-token KV: each request owns one slot of the layer's compressed state (recurrent
state [H, Dv, Dk] float32 and conv window [K - 1, 3 * H * D]) in kv/state_pool.py; the
slot ids and token ranges come from `ForwardContext.linear_metadata`.

Tensor parallel (`tp`): heads are split across ranks, everything per head stays on its
rank (q/k/v rows and their conv taps, the decay and output-gate rows, A_log, dt_bias,
beta, the state slot's heads and window channels); f_a and g_a (rank-wide low-rank
inputs: `in_proj`'s replicated shards) and o_norm (per head, shared) are replicated;
o_proj is row-parallel, the layer's one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from batchgen.forward_context import get_forward_context
from batchgen.layers import kda_ops
from batchgen.layers.linear import merged_shards
from batchgen.layers.norm import RMSNorm
from batchgen.layers.parallel import ColumnParallelLinear, RowParallelLinear
from batchgen.layers.tp_group import SINGLE, TPGroup


class ConvWeight(ColumnParallelLinear):
    """Depthwise conv taps [channels, K] stacked from q/k/v checkpoint tensors, which come
    as Conv1d weights [channels, 1, K]; under tensor parallel this rank's channels of
    each. Not a projection: the short convolution reads the taps as a matrix
    (kda_ops.short_conv), so they stay in the model's dtype whatever the checkpoint or
    EngineConfig.quantization asks (quantizable=False), as checkpoints store them."""

    def __init__(
        self, kernel: int, channels: int, shards: dict[str, tuple[int, int]], tp: TPGroup
    ) -> None:
        super().__init__(kernel, channels, shards=shards, tp=tp, quantizable=False)

    def load(self, param: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        super().load(param, tensor.squeeze(1) if tensor.dim() == 3 else tensor, shard)


class KimiDeltaAttention(nn.Module):
    """One KDA layer. `layer_id`: its index among all decoder layers; `state_index`: its
    index among the KDA layers (its entry in `ForwardContext.linear_states`)."""

    def __init__(
        self,
        config,
        layer_id: int,
        state_index: int,
        chunk_size: int = 64,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        tp = tp or SINGLE
        self.tp = tp
        self.layer_id = layer_id
        self.state_index = state_index
        self.chunk_size = chunk_size
        full_heads = config.linear_num_heads
        self.num_heads = tp.split(full_heads, "linear_num_heads")  # this rank's
        self.head_dim = config.linear_head_dim
        self.conv_kernel = config.linear_conv_kernel_dim
        self.eps = config.rms_norm_eps
        hidden, dim = config.hidden_size, self.head_dim
        full_width = full_heads * dim
        self.proj_dim = self.num_heads * dim  # this rank's q (k, v) width
        qkv = {"q": full_width, "k": full_width, "v": full_width}
        parts = merged_shards({**qkv, "b": full_heads, "f_a": dim, "g_a": dim})
        self.in_proj = ColumnParallelLinear(
            hidden, 3 * full_width + full_heads + 2 * dim, shards=parts, tp=tp,
            replicated=("f_a", "g_a"),
        )  # fmt: skip
        self.conv1d = ConvWeight(self.conv_kernel, 3 * full_width, shards=merged_shards(qkv), tp=tp)
        self.f_b_proj = ColumnParallelLinear(dim, full_width, tp=tp)
        # the decay's parameters stay float32 whatever the model dtype (as checkpoints keep
        # them): the gate is computed in float32 and its rounding compounds over the recurrence
        fp32 = {"dtype": torch.float32}
        heads, width = self.num_heads, self.proj_dim
        self.A_log = nn.Parameter(torch.zeros(1, 1, heads, 1, **fp32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.zeros(width, **fp32), requires_grad=False)
        self.g_b_proj = ColumnParallelLinear(dim, full_width, tp=tp)
        self.o_norm = RMSNorm(dim, self.eps)
        self.o_proj = RowParallelLinear(full_width, hidden, tp=tp)

    @property
    def _in_widths(self) -> tuple[int, int, int, int]:
        """This rank's columns of in_proj's output: q k v, b, f_a, g_a."""
        return (3 * self.proj_dim, self.num_heads, self.head_dim, self.head_dim)

    @property
    def conv_dim(self) -> int:
        """Channels of the conv window (q, k and v)."""
        return 3 * self.proj_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (the packed step) -> [T, hidden]."""
        ctx = get_forward_context()
        if ctx.before_layer is not None:
            ctx.before_layer(self.layer_id)
        meta = ctx.linear_metadata
        states, windows = ctx.linear_states[self.state_index]
        kda_ops.reset_fresh_slots(states, windows, meta)
        rows, heads, dim = x.shape[0], self.num_heads, self.head_dim
        qkv, b, f_a, g_a = self.in_proj(x).split(self._in_widths, dim=-1)
        qkv = kda_ops.short_conv(qkv, self.conv1d.weight, windows, meta)
        q, k, v = (t.view(rows, heads, dim) for t in qkv)
        f = self.f_b_proj(f_a).view(rows, heads, dim)  # the decay, raw
        raw = kda_ops.RawGates(self.A_log, self.dt_bias)
        o = kda_ops.kda_attention(q, k, v, f, b, states, meta, self.chunk_size, raw)
        gate = self.g_b_proj(g_a).view(rows, heads, dim)
        o = kda_ops.output_norm(o, self.o_norm.weight, gate, self.eps)
        return self.o_proj(o.reshape(rows, heads * dim))

    def checkpoint_target(self, name: str) -> tuple[nn.Module, str, str | None]:
        """(module, param, shard) for a checkpoint name relative to `self_attn.`, in the
        Moonshot checkpoint's naming (q_proj, q_conv1d, f_a_proj, A_log, ...) or
        transformers' (conv1d.weight stacked, forget_gate.*); KeyError for others."""
        if name.startswith("forget_gate."):
            name = name[len("forget_gate.") :]
        if name in ("A_log", "dt_bias"):
            return self, name, None
        proj, _, param = name.rpartition(".")
        if proj in _STACKED:
            return self.in_proj, param, _STACKED[proj]
        if proj in ("q_conv1d", "k_conv1d", "v_conv1d"):
            return self.conv1d, param, proj[0]
        if proj == "conv1d":
            return self.conv1d, param, None
        if proj in _PLAIN and param == "weight":
            return getattr(self, proj), param, None
        raise KeyError(name)

    def load(self, param: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        """A_log or dt_bias from its full checkpoint tensor (any shape holding the layer's
        heads, then per head its channels for dt_bias): this rank's heads of it."""
        if param not in ("A_log", "dt_bias") or shard is not None:
            raise ValueError(f"unexpected KDA parameter {param!r} (A_log, dt_bias)")
        target = getattr(self, param)
        full, n = tensor.reshape(-1), target.numel()
        if full.numel() != n * self.tp.size:
            raise ValueError(
                f"{param}: shape {tuple(tensor.shape)} does not hold "
                f"{self.tp.size} x {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(full[self.tp.rank * n : (self.tp.rank + 1) * n].reshape(target.shape))

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor (name relative to `self_attn.`) into its place."""
        module, param, shard = self.checkpoint_target(name)
        if hasattr(module, "load"):
            module.load(param, tensor, shard)
            return
        target = getattr(module, param)
        if tensor.numel() != target.numel():
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} != expected {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor.reshape(target.shape))


# checkpoint projections of x stacked into in_proj, and the shard each fills
_STACKED = {
    "q_proj": "q",
    "k_proj": "k",
    "v_proj": "v",
    "b_proj": "b",
    "f_a_proj": "f_a",
    "g_a_proj": "g_a",
}
_PLAIN = ("f_b_proj", "g_b_proj", "o_norm", "o_proj")
