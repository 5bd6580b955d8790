"""Kimi Linear: Kimi Delta Attention (linear attention) layers interleaved with MLA
full-attention layers, dense MLPs first, then mixture-of-experts MLPs.

    config.layer_types[i]      "linear_attention" -> KimiDeltaAttention (a state slot)
                               "full_attention"   -> MLAttention, NoPE (latent KV pages)
    config.mlp_layer_types[i]  "dense" -> SwiGLU MLP    "sparse" -> DeepseekV3MoE

Only the MLA layers keep per-token KV: the KV pool has `num_kv_layers` layers, and MLA
layer i of the decoder uses KV layer `kv_index` (its rank among the MLA layers). The KDA
layers are listed in `linear_layers` (their `state_index` order), from which the engine
sizes the compressed-state pool.

Tensor parallel (`tp`): KDA heads split (each rank's state slots hold its heads), MLA
heads split over a replicated latent cache, MLPs and experts as in DeepSeek-V3, the
vocabulary split for the embedding and lm_head. Expert parallel (`ep`): the MoE layers'
experts as in DeepSeek-V3 under `ep`.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch
from torch import nn

from batchgen.kv_state import KVState
from batchgen.layers import mla
from batchgen.layers.expert_parallel import ExpertParallel
from batchgen.layers.kda import KimiDeltaAttention
from batchgen.layers.mla import MLAttention
from batchgen.layers.moe import DeepseekV3MoE
from batchgen.layers.norm import RMSNorm
from batchgen.layers.tp_group import TPGroup
from batchgen.models.deepseek_v3 import MLAMoEDecode, moe_layer
from batchgen.models.llama import DecoderStack, LlamaMLP

_LAYER = re.compile(r"layers\.(\d+)\.")
# Moonshot's checkpoint names (what save_pretrained writes too) -> transformers' modules
_MOONSHOT_MLP = "block_sparse_moe."
_MOONSHOT_EXPERT = re.compile(r"experts\.(\d+)\.(w1|w2|w3)\.weight$")
_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
FULL, LINEAR = "full_attention", "linear_attention"


def moe_config(config) -> SimpleNamespace:
    """The routing and size fields DeepseekV3MoE reads, under DeepSeek-V3's names, from a
    KimiLinearConfig (num_experts, n_group, ... behind transformers' attribute map).
    Kimi Linear routes as DeepSeek-V3 does ("noaux_tc": sigmoid scores, correction bias
    for choosing, group limit, normalised top-k times routed_scaling_factor)."""
    return SimpleNamespace(
        hidden_act=config.hidden_act,
        hidden_size=config.hidden_size,
        moe_intermediate_size=config.moe_intermediate_size,
        n_routed_experts=config.num_local_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        n_group=config.n_group or 1,
        topk_group=config.topk_group or 1,
        norm_topk_prob=config.norm_topk_prob,
        routed_scaling_factor=config.routed_scaling_factor,
        n_shared_experts=config.n_shared_experts,
    )


class KimiLinearDecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer_id: int,
        kv_index: int,
        state_index: int,
        tp: TPGroup | None = None,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.is_linear = config.layer_types[layer_id] == LINEAR
        if self.is_linear:
            self.self_attn = KimiDeltaAttention(config, layer_id, state_index, tp=tp)
        else:
            self.self_attn = MLAttention(config, kv_index, rotary=None, tp=tp)
        sparse = config.mlp_layer_types[layer_id] == "sparse"
        self.mlp = moe_layer(moe_config(config), tp, ep) if sparse else LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.forward_residual(x, residual)
        h = self.self_attn(h) if self.is_linear else self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm.forward_residual(h, residual)
        return self.mlp(h), residual


class KimiLinearForCausalLM(MLAMoEDecode, DecoderStack):
    """Weight names: Moonshot's checkpoints (what transformers' save_pretrained writes:
    `block_sparse_moe.` for every MLP, experts' w1/w3/w2 for gate/up/down, per-projection
    q/k/v_conv1d, A_log and dt_bias beside the projections) and transformers' in-memory
    names (`mlp.`, fused experts, conv1d, forget_gate.*). A KDA layer maps its own
    (KimiDeltaAttention.checkpoint_target), a MoE MLP its own (per-expert or fused), a
    dense MLP's gate/up are stacked."""

    attention_backends = mla.BACKENDS
    stacked = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
    tensor_parallel = True
    expert_parallel = True

    def __init__(
        self,
        config,
        max_positions: int,
        tp: TPGroup | None = None,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        _check_supported(config)
        self.config = config
        self.tp = tp
        self.rotary = None  # NoPE: MLA layers take no position encoding
        # replicated under tensor parallel: every rank stores the whole latent
        self.kv_state = KVState.latent(config.kv_lora_rank + config.qk_rope_head_dim)
        self.build_embedding(config, tp)
        layers, kv_index, state_index = [], 0, 0
        for i, kind in enumerate(config.layer_types):
            layers.append(KimiLinearDecoderLayer(config, i, kv_index, state_index, tp, ep))
            kv_index += kind == FULL
            state_index += kind == LINEAR
        self.layers = nn.ModuleList(layers)
        self.num_kv_layers = kv_index
        self.linear_layers = [layer.self_attn for layer in layers if layer.is_linear]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.build_lm_head(config, tp)

    def checkpoint_target(self, name: str) -> tuple[nn.Module, str, str | None] | None:
        """(module, parameter, shard) for a transformers weight name; None to skip."""
        name = self.decoder_name(name)
        if name is None:
            return None
        layer = _LAYER.match(name)
        if layer:
            index = int(layer[1])
            if index >= len(self.layers):
                raise KeyError(name)
            decoder = self.layers[index]
            rest = name[len(layer[0]) :]
            if rest.startswith(_MOONSHOT_MLP):
                rest = "mlp." + _moonshot_expert(rest[len(_MOONSHOT_MLP) :])
                name = layer[0] + rest
            if decoder.is_linear and rest.startswith("self_attn."):
                return decoder.self_attn.checkpoint_target(rest[len("self_attn.") :])
            if isinstance(decoder.mlp, DeepseekV3MoE) and rest.startswith("mlp."):
                return decoder.mlp.checkpoint_target(rest[len("mlp.") :])
        return self.module_target(name)


def _moonshot_expert(name: str) -> str:
    """experts.{e}.w1/w3/w2.weight (gate, up, down) under transformers' names."""
    match = _MOONSHOT_EXPERT.fullmatch(name)
    if match is None:
        return name
    return f"experts.{match[1]}.{_EXPERT_PROJ[match[2]]}.weight"


def _check_supported(config) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Kimi Linear with hidden_act={act!r} is not supported (silu)")
    types = list(config.layer_types)
    unknown = sorted(set(types) - {FULL, LINEAR})
    if unknown or len(types) != config.num_hidden_layers:
        raise ValueError(
            f"layer_types must name {config.num_hidden_layers} layers, each {FULL!r} or "
            f"{LINEAR!r}; got {types}"
        )
    if FULL not in types:
        raise ValueError("Kimi Linear without a full-attention (MLA) layer is not supported")
