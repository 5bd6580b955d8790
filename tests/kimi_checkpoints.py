"""Tiny random Kimi Linear checkpoints (transformers' model, saved as safetensors): shared
by tests/models and tests/distributed."""

from __future__ import annotations

import math

import torch
from conftest import save_tiny_tokenizer


def tiny_config(layer_types, first_k_dense_replace=1, **overrides):
    from transformers import KimiLinearConfig

    n = len(layer_types)
    cfg = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=n,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=24,
        num_local_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        linear_num_heads=2,
        linear_head_dim=16,
        linear_conv_kernel_dim=4,
        layer_types=list(layer_types),
        mlp_layer_types=["dense" if i < first_k_dense_replace else "sparse" for i in range(n)],
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config = KimiLinearConfig(**{**cfg, **overrides})
    config.architectures = ["KimiLinearForCausalLM"]
    return config


def save_tiny_kimi(path, seed: int = 0, **pattern):
    """A random transformers Kimi Linear checkpoint (safetensors) and the model itself."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(**pattern)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights give peaked distributions: fewer near-ties
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decay rates exp(A_log) in [1, 16], as fla inits
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            elif name.endswith("dt_bias"):  # softplus(dt_bias) in [1e-3, 1e-1]
                dt = torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1)).exp()
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif p.dim() >= 2:  # matrices, stacked experts and conv taps too
                p.normal_(0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # choosing differs from weighting
                b.normal_(0, 0.1)
    model.save_pretrained(path)
    save_tiny_tokenizer(path, config.vocab_size)
    return model.eval()


def random_kda_module(config, seed: int = 0, std: float | None = None):
    """transformers' KDA module with random weights as transformers initialises them
    (projections normal(0, std), by default initializer_range; A_log, dt_bias as fla
    does)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    torch.manual_seed(seed)
    layer = kimi.KimiLinearDeltaAttention(config, layer_idx=0).float().eval()
    std = config.initializer_range if std is None else std
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            elif name.endswith("dt_bias"):  # softplus(dt_bias) in [1e-3, 1e-1], as fla inits
                dt = torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1)).exp()
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith("o_norm.weight"):
                p.uniform_(0.5, 1.5)
            elif "conv1d" in name:
                p.normal_(0, 1 / math.sqrt(p.shape[-1]))
            else:  # projections
                p.normal_(0, std)
    return layer
