"""Tiny random DeepSeek-V3 checkpoints (transformers' model, saved as safetensors) and the
configs the DeepSeek-V3 tests run: shared by tests/models and tests/distributed."""

from __future__ import annotations

from conftest import TINY_SIZES, save_random_model

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.9,  # != mscale_all_dim: cos/sin carry an attention factor too
    "mscale_all_dim": 1.0,
}
CONFIGS = {  # the base config is all dense (first_k_dense_replace = num_hidden_layers)
    "q_lora": {},
    "plain_q_no_interleave": {"q_lora_rank": None, "rope_interleave": False},
    "yarn": {"rope_scaling": YARN},
    # a dense first layer, then MoE: 8 experts in 2 groups, 1 group kept, 2 experts a token
    "moe_dense_first": {"first_k_dense_replace": 1},
    # Kimi-K2's shape: no group limit, two shared experts, plain q, YaRN
    "moe_kimi_like": {
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 2,
        "q_lora_rank": None,
        "rope_scaling": YARN,
    },
}


def tiny_config(**overrides):
    from transformers import DeepseekV3Config

    cfg = dict(
        TINY_SIZES,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=24,
        first_k_dense_replace=2,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
    )
    config = DeepseekV3Config(**{**cfg, **overrides})
    config.architectures = ["DeepseekV3ForCausalLM"]
    return config


def save_tiny_deepseek(path, seed: int = 0, **overrides):
    """A random transformers DeepseekV3 checkpoint (safetensors) and the model itself."""
    return save_random_model(path, tiny_config(**overrides), seed)
