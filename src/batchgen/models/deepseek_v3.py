"""DeepSeek-V3 decoders (and other checkpoints whose config names DeepseekV3ForCausalLM):
MLA attention over a latent KV cache, dense MLPs in the first `first_k_dense_replace`
layers, mixture-of-experts MLPs after them.

Tensor parallel (`tp`): MLA heads split (the latent cache replicated: every rank's pool
holds the same latents), dense MLPs' intermediate features split as Llama's, routed
experts in one contiguous block per rank with the shared experts' features split, the
vocabulary split for the embedding and lm_head. Per layer: one all-reduce after o_proj,
one after the MLP (dense or MoE); logits gathered.

Expert parallel (`ep`, layers/expert_parallel.py; with tensor parallel: ep over the same
ranks): the MoE layers' routed experts in one block per rank, each token's pairs sent to
their experts' ranks and back by all-to-all, the shared experts replicated; attention,
dense MLPs and the vocabulary as `tp` says."""

from __future__ import annotations

import re

import torch
from torch import nn

from batchgen.kv_state import KVState
from batchgen.layers import mla
from batchgen.layers.expert_parallel import ExpertParallel
from batchgen.layers.mla import MLAttention
from batchgen.layers.moe import DeepseekV3MoE
from batchgen.layers.norm import RMSNorm
from batchgen.layers.rotary import RotaryEmbedding
from batchgen.layers.tp_group import TPGroup
from batchgen.models.llama import DecoderStack, LlamaMLP

_LAYER = re.compile(r"layers\.(\d+)\.")


def is_moe_layer(config, layer_id: int) -> bool:
    """Layers from first_k_dense_replace on route tokens to experts (when there are any)."""
    first_moe = getattr(config, "first_k_dense_replace", None) or 0
    return bool(getattr(config, "n_routed_experts", None)) and layer_id >= first_moe


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer_id: int,
        rotary: RotaryEmbedding,
        tp: TPGroup | None = None,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = MLAttention(config, layer_id, rotary, tp)
        if is_moe_layer(config, layer_id):
            self.mlp = moe_layer(config, tp, ep)
        else:
            self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.forward_residual(x, residual)
        h = self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm.forward_residual(h, residual)
        return self.mlp(h), residual


def moe_layer(config, tp: TPGroup | None, ep: ExpertParallel | None) -> DeepseekV3MoE:
    """A MoE MLP: expert parallel where `ep` is given (then tp does not split it), else
    tensor parallel as `tp` says."""
    return DeepseekV3MoE(config, tp=None if ep is not None else tp, ep=ep)


class MLAMoEDecode:
    """What the engine asks of a model with MLA and MoE layers (DeepSeek-V3, Kimi Linear)
    before it captures decode graphs and plans the decode kernel's splits."""

    def graph_safe(self, dtype: torch.dtype, device: torch.device | str) -> bool:
        """Whether the decode forward (Triton backend) is free of host syncs for `dtype`
        on `device`, so CUDA graphs may capture it. MLA, norms, dense MLPs and KDA layers
        always are; MoE layers only where their experts take the grouped GEMM (bfloat16
        on Hopper / Blackwell, sizes multiples of 8). Elsewhere (float32 on a GPU, older
        GPUs) the engine decodes eagerly."""
        return all(
            layer.mlp.graph_safe(dtype, device)
            for layer in self.layers
            if isinstance(layer.mlp, DeepseekV3MoE)
        )

    def decode_split_heads(self, dtype: torch.dtype, device: torch.device | str) -> int:
        """Programs per (request, split) of the decode kernel, for the engine's split plan
        (this rank's heads under tensor parallel)."""
        tp = getattr(self, "tp", None)
        heads = self.config.num_attention_heads // (1 if tp is None else tp.size)
        return mla.decode_split_heads(heads, dtype, device)


class DeepseekV3ForCausalLM(MLAMoEDecode, DecoderStack):
    """Weight names follow transformers' checkpoints; a dense MLP's gate/up are stacked,
    a MoE MLP maps its own names (DeepseekV3MoE.checkpoint_target: per-expert or fused).
    Multi-token-prediction layers past num_hidden_layers are not loaded; FP8 weights
    arrive dequantized (the loader joins each with its weight_scale_inv).

    With `tp` (layers/tp_group.py) this rank's tensor-parallel share (module docstring);
    None: one process, the plain layers. With `ep` its MoE layers expert parallel
    (module docstring). Its weights load from the full checkpoint
    tensors, each parallel layer cutting its slice."""

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
        self.rotary = RotaryEmbedding(config, config.qk_rope_head_dim, max_positions)
        # replicated under tensor parallel: every rank stores the whole latent
        self.kv_state = KVState.latent(config.kv_lora_rank + config.qk_rope_head_dim)
        self.build_embedding(config, tp)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(config, i, self.rotary, tp, ep)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.build_lm_head(config, tp)

    def checkpoint_target(self, name: str) -> tuple[nn.Module, str, str | None] | None:
        """(module, parameter, shard) for a transformers weight name; None to skip."""
        name = self.decoder_name(name)
        if name is None:
            return None
        layer = _LAYER.match(name)
        if "rotary_emb" in name or (layer and int(layer[1]) >= len(self.layers)):
            return None  # multi-token-prediction layers: not part of the decoder
        mlp = f"{layer[0]}mlp." if layer else None
        if mlp and name.startswith(mlp):
            moe = self.layers[int(layer[1])].mlp
            if isinstance(moe, DeepseekV3MoE):
                return moe.checkpoint_target(name[len(mlp) :])
        return self.module_target(name)


def _check_supported(config) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"DeepSeek-V3 MLPs with hidden_act={act!r} are not supported (silu)")
