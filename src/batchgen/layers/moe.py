"""The mixture-of-experts feed-forward layer of DeepSeek-V3, Kimi-K2 and Moonlight.

    y = shared_experts(x) + sum over the token's chosen experts e of weight_e * expert_e(x)

with expert_e(x) = down_e(silu(gate_e x) * up_e x) and the routing of moe_routing.py.

Routed experts are computed token-sorted (rows of [T * top_k] sorted by expert id, group
offsets from a scatter-add, no host synchronisation) and then multiplied group by group:

- GPU path: `torch._grouped_mm` (bfloat16 on Hopper/Blackwell, see grouped_mm_available):
  two grouped GEMMs on fixed shapes, nothing read back to the host, so a decode step can
  be captured in a CUDA graph.
- Reference path (everywhere else, the CPU in particular): the same sorted rows, one
  matmul per expert that has rows; it reads the group offsets on the host (`tolist`), so
  it cannot be captured.

Both paths add a token's top_k expert outputs in float32, in a fixed order, without
atomics: the same inputs give the same bits on every run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.layers.activation import silu_and_mul
from batchgen.layers.linear import Linear, merged_shards
from batchgen.layers.moe_routing import RoutingConfig, select_experts


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` serves x without a host sync: bfloat16 on a CUDA device
    of compute capability 9.x or 10.x (Hopper, Blackwell), a torch that has the op. On other
    GPUs the op falls back to a loop that copies the offsets to the host."""
    return grouped_mm_serves(x.dtype, x.device)


def grouped_mm_serves(dtype: torch.dtype, device: torch.device | str) -> bool:
    """grouped_mm_available for activations of `dtype` on `device`, before any exist."""
    device = torch.device(device)
    if not (hasattr(torch, "_grouped_mm") and device.type == "cuda" and dtype == torch.bfloat16):
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def grouped_mm_loop(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows a[offs[g-1]:offs[g]] times w[g]^T for each group g: [M, K] x [G, N, K] -> [M, N].
    Reference path: reads offs on the host."""
    out = a.new_empty(a.shape[0], w.shape[1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = F.linear(a[start:end], w[g])
        start = end
    return out


def grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """As grouped_mm_loop, in one `torch._grouped_mm` launch (w^T is column-major per
    group, as the op wants). No host synchronisation."""
    return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for x [T, H], gate_up [E, 2I, H]
    (gate rows, then up rows), down [E, H, I], weights [T, k], ids [T, k] -> [T, H] in
    x's dtype. use_grouped_mm None: the GPU path where grouped_mm_available(x) and the
    rows are 16-byte aligned (H and I multiples of 8), else the reference path."""
    t, k = ids.shape
    num_experts = gate_up.shape[0]
    if use_grouped_mm is None:
        aligned = x.shape[1] % 8 == 0 and down.shape[2] % 8 == 0
        use_grouped_mm = aligned and grouped_mm_available(x)
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # row r of the sorted block is pair order[r]
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # end row of each expert's group
    rows = x.index_select(0, order // k)
    mm = grouped_mm if use_grouped_mm else grouped_mm_loop
    h = mm(silu_and_mul(mm(rows, gate_up, offs)), down, offs)
    per_pair = torch.empty_like(h).index_copy_(0, order, h).view(t, k, -1)
    out = (per_pair.float() * weights.float().unsqueeze(-1)).sum(dim=1)
    return out.to(x.dtype)


class RoutedExperts(nn.Module):
    """The routed experts' weights, stacked: gate_up_proj [E, 2I, H] (expert e's
    gate_proj rows, then its up_proj rows) and down_proj [E, H, I], transformers 5's
    layout and names.

    `load(param, tensor, shard)` fills them from a checkpoint: shard None copies a whole
    fused tensor; shard "{e}.gate" / "{e}.up" (param gate_up_proj) and "{e}.down" (param
    down_proj) copy one expert's per-expert tensor. `shard_names(param)` lists them all."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype=None, device=None):
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        factory = {"dtype": dtype, "device": device}
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden, **factory), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden, inter, **factory), requires_grad=False
        )

    def shard_names(self, param: str) -> list[str]:
        parts = ("gate", "up") if param == "gate_up_proj" else ("down",)
        return [f"{e}.{p}" for e in range(self.num_experts) for p in parts]

    def load(self, param: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        if param not in ("gate_up_proj", "down_proj"):
            raise ValueError(f"unexpected expert parameter {param!r} (gate_up_proj, down_proj)")
        target = getattr(self, param)
        if shard is not None:
            if shard not in self.shard_names(param):
                raise ValueError(f"unexpected shard {shard!r} of {param}")
            expert, part = shard.split(".")
            target = target[int(expert)]
            if part == "gate":
                target = target[: self.inter]
            elif part == "up":
                target = target[self.inter :]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids)


class MoEGate(nn.Module):
    """Router: weight [E, H] and e_score_correction_bias [E], both kept in float32 (the
    logits are float32; the bias is a small float32 offset)."""

    def __init__(self, routing: RoutingConfig, hidden: int, device=None) -> None:
        super().__init__()
        self.routing = routing
        e = routing.num_experts
        factory = {"dtype": torch.float32, "device": device}
        self.weight = nn.Parameter(torch.empty(e, hidden, **factory), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e, **factory), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, top_k] float32, expert ids [T, top_k])."""
        logits = F.linear(x.float(), self.weight)
        return select_experts(logits, self.e_score_correction_bias, self.routing)


class GatedMLP(nn.Module):
    """down(silu(gate x) * up x), gate and up stacked in one Linear (shards gate, up)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        shards = merged_shards({"gate": inter, "up": inter})
        self.gate_up_proj = Linear(hidden, 2 * inter, shards=shards)
        self.down_proj = Linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DeepseekV3MoE(nn.Module):
    """The `mlp` of a DeepSeek-V3 / Kimi-K2 MoE decoder layer; forward(x [T, H]) -> [T, H].

    Parameters (router in float32, the rest in `dtype`):
        gate.weight                     [E, H]
        gate.e_score_correction_bias    [E]
        experts.gate_up_proj            [E, 2I, H]   I = moe_intermediate_size
        experts.down_proj               [E, H, I]
        shared_experts.gate_up_proj.weight  [2S, H]  S = I * n_shared_experts (absent if 0)
        shared_experts.down_proj.weight     [H, S]

    Checkpoint names under the layer's `mlp.` prefix -> (module, param, shard), see
    checkpoint_target; load_weight(name, tensor) applies it:
        gate.weight, gate.e_score_correction_bias       -> as named
        experts.{e}.gate_proj.weight   [I, H]           -> experts.gate_up_proj, "{e}.gate"
        experts.{e}.up_proj.weight     [I, H]           -> experts.gate_up_proj, "{e}.up"
        experts.{e}.down_proj.weight   [H, I]           -> experts.down_proj,    "{e}.down"
        experts.gate_up_proj           [E, 2I, H] fused -> experts.gate_up_proj, whole
        experts.down_proj              [E, H, I]  fused -> experts.down_proj,    whole
        shared_experts.gate_proj.weight / up_proj.weight -> shared_experts.gate_up_proj, gate / up
        shared_experts.down_proj.weight                  -> shared_experts.down_proj
    DeepSeek's and Kimi's hub checkpoints, and transformers 5's save_pretrained, write the
    per-expert names; the fused names are transformers 5's in-memory state_dict.
    """

    def __init__(self, config, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported by DeepseekV3MoE (silu)")
        self.routing = RoutingConfig.from_hf(config)
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.gate = MoEGate(self.routing, hidden, device=device)
        self.experts = RoutedExperts(self.routing.num_experts, hidden, inter, dtype, device)
        n_shared = getattr(config, "n_shared_experts", None) or 0
        self.shared_experts = (
            GatedMLP(hidden, inter * n_shared).to(device=device, dtype=dtype) if n_shared else None
        )

    def graph_safe(self, dtype: torch.dtype, device: torch.device | str) -> bool:
        """Whether forward runs without a host sync for `dtype` activations on `device`
        (so a CUDA graph can capture it): fused_experts takes the grouped-GEMM path there."""
        hidden, inter = self.experts.gate_up_proj.shape[2], self.experts.inter
        return hidden % 8 == 0 and inter % 8 == 0 and grouped_mm_serves(dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def checkpoint_target(self, name: str) -> tuple[nn.Module, str, str | None]:
        """(module, param, shard) for a checkpoint name relative to `mlp.`; KeyError for
        a name this layer does not hold. module.load(param, tensor, shard) where the
        module has `load`, else a plain copy into getattr(module, param)."""
        parts = name.split(".")
        if parts[0] == "gate" and len(parts) == 2 and parts[1] in _GATE_PARAMS:
            return self.gate, parts[1], None
        if parts[0] == "experts":
            if len(parts) == 2 and parts[1] in ("gate_up_proj", "down_proj"):
                return self.experts, parts[1], None
            if len(parts) == 4 and parts[1].isdigit() and parts[3] == "weight":
                expert, proj = int(parts[1]), parts[2]
                if expert < self.routing.num_experts and proj in _EXPERT_PROJ:
                    param, part = _EXPERT_PROJ[proj]
                    return self.experts, param, f"{expert}.{part}"
        if parts[0] == "shared_experts" and self.shared_experts is not None and len(parts) == 3:
            proj, param = parts[1], parts[2]
            if proj in ("gate_proj", "up_proj") and param == "weight":
                return self.shared_experts.gate_up_proj, "weight", proj[: -len("_proj")]
            if proj == "down_proj" and param == "weight":
                return self.shared_experts.down_proj, "weight", None
        raise KeyError(name)

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor (name relative to `mlp.`) into its place."""
        module, param, shard = self.checkpoint_target(name)
        if hasattr(module, "load"):
            module.load(param, tensor, shard)
        else:
            target = getattr(module, param)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensor)


_GATE_PARAMS = ("weight", "e_score_correction_bias")
_EXPERT_PROJ = {
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    "down_proj": ("down_proj", "down"),
}
