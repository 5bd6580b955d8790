"""Tiny random Kimi Linear checkpoints (transformers' model, saved as safetensors): shared
by tests/models and tests/distributed."""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager

import pytest
import torch
from conftest import TINY_SIZES, save_random_model


def tiny_config(layer_types, first_k_dense_replace=1, **overrides):
    from transformers import KimiLinearConfig

    n = len(layer_types)
    cfg = dict(
        TINY_SIZES,
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
    )
    config = KimiLinearConfig(**{**cfg, **overrides})
    config.architectures = ["KimiLinearForCausalLM"]
    return config


def save_tiny_kimi(path, seed: int = 0, **pattern):
    """A random transformers Kimi Linear checkpoint (safetensors) and the model itself."""
    return save_random_model(path, tiny_config(**pattern), seed)


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


def run_kda_step(layer, pool, parts: list[tuple[torch.Tensor, int, bool]]) -> list[torch.Tensor]:
    """One packed step of a KDA layer over state pool `pool`: parts are (x rows [n,
    hidden], slot, has_state); outputs per part."""
    from batchgen.forward_context import (
        AttentionMetadata,
        ForwardContext,
        LinearAttentionMetadata,
        LinearSeq,
        bind_forward_context,
    )

    seqs, start = [], 0
    for rows, slot, has_state in parts:
        seqs.append(LinearSeq(q_start=start, q_len=rows.shape[0], slot=slot, has_state=has_state))
        start += rows.shape[0]
    x = torch.cat([rows for rows, _, _ in parts])
    ctx = ForwardContext(
        metadata=AttentionMetadata(
            num_tokens=start, slot_mapping=torch.zeros(start, dtype=torch.int64)
        ),
        kv_caches=[],
        linear_states=pool.layer_states(),
        linear_metadata=LinearAttentionMetadata.build(seqs, "cpu"),
    )
    with torch.no_grad(), bind_forward_context(ctx):
        out = layer(x)
    return [out[s.q_start : s.q_start + s.q_len] for s in seqs]


@contextmanager
def transformers_torch_kda():
    """transformers' Kimi Linear on its own torch KDA and short convolution: it binds
    fla-core's kernels in their place where fla-core is installed, and the references
    here are its torch code, on the CPU. Put back on leaving."""
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    names = [
        "chunk_kimi_delta_attention",
        "recurrent_kimi_delta_attention",
        "causal_conv1d_fn",
        "causal_conv1d_update",
    ]
    with pytest.MonkeyPatch.context() as mp:
        for name in names:
            mp.setattr(kimi, name, inspect.unwrap(getattr(kimi, name)))
        yield
