"""The mixture-of-experts feed-forward layer of DeepSeek-V3, Kimi-K2 and Moonlight.

    y = shared_experts(x) + sum over the token's chosen experts e of weight_e * expert_e(x)

with expert_e(x) = down_e(silu(gate_e x) * up_e x), the routing of moe_routing.py and
the routed experts' weights and math of routed_experts.py.
"""

from __future__ import annotations

import torch
from torch import nn

from batchgen.layers import batch_invariant
from batchgen.layers.activation import silu_and_mul
from batchgen.layers.expert_parallel import ExpertParallel, dispatch_combine
from batchgen.layers.linear import Linear, merged_shards
from batchgen.layers.moe_routing import RoutingConfig, select_experts
from batchgen.layers.parallel import ColumnParallelLinear, RowParallelLinear
from batchgen.layers.quant.fp8 import w8a8_serves_dtype as fp8_experts_serve
from batchgen.layers.routed_experts import RoutedExperts, grouped_mm_serves
from batchgen.layers.tp_group import TPGroup


class MoEGate(nn.Module):
    """Router: weight [E, H] and e_score_correction_bias [E], both kept in float32 (the
    logits are float32; the bias is a small float32 offset).

    The checkpoints of this family store the router weight in the model's dtype
    (bfloat16) beside the float32 bias. Where the loaded weight is exactly that narrower
    dtype's values (`after_load`), a CUDA forward multiplies the activations as they are
    by that copy with float32 products and sums (`torch.mm(..., out_dtype=float32)`):
    the same terms as the float32 GEMM of the widened inputs, summed in another order,
    without widening the activations first (a copy of x per layer) or running the
    matmul in float32."""

    def __init__(
        self,
        routing: RoutingConfig,
        hidden: int,
        device=None,
        act_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.routing = routing
        e = routing.num_experts
        factory = {"dtype": torch.float32, "device": device}
        self.weight = nn.Parameter(torch.empty(e, hidden, **factory), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e, **factory), requires_grad=False)
        self.act_dtype = act_dtype or torch.get_default_dtype()
        self.register_buffer("weight_narrow", None, persistent=False)

    def after_load(self) -> None:
        """Keep weight in act_dtype where that holds it exactly (see the class)."""
        self.weight_narrow = None
        if self.act_dtype == torch.float32 or self.weight.is_meta:
            return
        narrow = self.weight.detach().to(self.act_dtype)
        if torch.equal(narrow.float(), self.weight.detach()):
            self.weight_narrow = narrow

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, top_k] float32, expert ids [T, top_k])."""
        narrow = self.weight_narrow
        if narrow is not None and x.is_cuda and x.dtype == narrow.dtype:
            logits = torch.mm(x, narrow.t(), out_dtype=torch.float32)
        else:
            logits = batch_invariant.linear(x.float(), self.weight)
        return select_experts(logits, self.e_score_correction_bias, self.routing)


class GatedMLP(nn.Module):
    """down(silu(gate x) * up x), gate and up stacked in one Linear (shards gate, up).
    With `tp`: intermediate features split across ranks, down_proj's output left as this
    rank's partial sum (the caller all-reduces it)."""

    def __init__(self, hidden: int, inter: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        shards = merged_shards({"gate": inter, "up": inter})
        if tp is None:
            self.gate_up_proj = Linear(hidden, 2 * inter, shards=shards)
            self.down_proj = Linear(inter, hidden)
        else:
            self.gate_up_proj = ColumnParallelLinear(hidden, 2 * inter, shards=shards, tp=tp)
            self.down_proj = RowParallelLinear(inter, hidden, tp=tp, reduce_output=False)

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

    With `tp` (tensor parallel, expert parallel for the routed experts): every rank
    routes every token alike (replicated router), computes its block of experts'
    contributions (RoutedExperts) and its slice of the shared experts' intermediate
    features, and one all-reduce sums them: y on every rank. The expert names stay the
    checkpoint's; E must divide by the size (ValueError otherwise).

    With `ep` (expert parallel, layers/expert_parallel.py) instead: the routed experts in
    one block per rank of ep.group, every token sent to its experts' ranks and their
    outputs back by all-to-all, the shared experts replicated; the router replicated.
    forward takes this rank's own tokens (ep.local_tokens) or every rank's same tokens
    (then each rank runs a slice, and the slices are gathered).
    """

    def __init__(
        self,
        config,
        dtype: torch.dtype | None = None,
        device=None,
        tp: TPGroup | None = None,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        if tp is not None and ep is not None:
            raise ValueError("DeepseekV3MoE takes tp (all-reduced experts) or ep, not both")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported by DeepseekV3MoE (silu)")
        self.routing = RoutingConfig.from_hf(config)
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.gate = MoEGate(self.routing, hidden, device=device, act_dtype=dtype)
        split = tp if ep is None else ep.group
        self.experts = RoutedExperts(self.routing.num_experts, hidden, inter, dtype, device, split)
        n_shared = getattr(config, "n_shared_experts", None) or 0
        self.shared_experts = (
            GatedMLP(hidden, inter * n_shared, tp).to(device=device, dtype=dtype)
            if n_shared
            else None
        )
        self.tp, self.ep = tp, ep

    def graph_safe(self, dtype: torch.dtype, device: torch.device | str) -> bool:
        """Whether forward runs without a host sync for `dtype` activations on `device`
        (so a CUDA graph can capture it): fused_experts takes the grouped-GEMM path there,
        and an expert-parallel dispatch reads no split sizes on the host: the
        fixed-capacity one (of replicated tokens: every rank replays the same bucket; of
        local tokens, attention data parallel's, only with their bound `max_tokens`:
        every rank replays the bucket the ranks agree, its buffers that bucket's)."""
        ep = self.ep
        if ep is not None and ep.size > 1 and ep.local_tokens and ep.max_tokens is None:
            return False
        if self.experts.group_size is not None:  # INT4: the Triton GEMMs on CUDA
            return torch.device(device).type == "cuda"
        if self.experts.fp8_block is not None:  # FP8: the Triton W8A8 GEMMs where they run
            return fp8_experts_serve(dtype, device)
        hidden, inter = self.experts.hidden, self.experts.inter
        return hidden % 8 == 0 and inter % 8 == 0 and grouped_mm_serves(dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ep is not None:
            return self.ep.forward(x, self._dispatched)
        weights, ids = self.gate(x)
        # the shared experts' output is added where the routed sum is made (one pass)
        shared = None if self.shared_experts is None else self.shared_experts(x)
        out = self.experts(x, weights, ids, residual=shared)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _dispatched(self, x: torch.Tensor, capacity: int | None) -> torch.Tensor:
        """This rank's tokens through the experts of every rank (expert parallel);
        capacity: the fixed-capacity dispatch's tokens a rank (ExpertParallel.forward)."""
        weights, ids = self.gate(x)
        shared = None if self.shared_experts is None else self.shared_experts(x)
        num, group = self.routing.num_experts, self.ep.group
        return dispatch_combine(x, weights, ids, self.experts, num, group, shared, capacity)

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
