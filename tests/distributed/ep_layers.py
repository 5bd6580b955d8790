"""The one-process DeepSeek-V3 MoE layer the expert-parallel tests compare with, and a
rank's expert-parallel copy of it: routed experts only (no dense layer), one shared
expert, 8 experts of the tiny config."""

from __future__ import annotations

import torch
from deepseek_checkpoints import tiny_config

from batchgen.layers.expert_parallel import ExpertParallel
from batchgen.layers.moe import DeepseekV3MoE

CONFIG = dict(first_k_dense_replace=0, n_shared_experts=1)


def full_moe() -> DeepseekV3MoE:
    """The whole layer, every weight drawn from normal(0, 0.3) after seed 0."""
    torch.manual_seed(0)
    moe = DeepseekV3MoE(tiny_config(**CONFIG))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def ep_moe(full: DeepseekV3MoE, ep: ExpertParallel) -> DeepseekV3MoE:
    """The layer under `ep` with full's weights: its rank's block of the routed experts,
    the rest (router, shared expert) whole."""
    moe = DeepseekV3MoE(tiny_config(**CONFIG), ep=ep)
    local = moe.experts.local_experts
    moe.load_state_dict(
        {
            **full.state_dict(),
            "experts.gate_up_proj": full.experts.gate_up_proj[local],
            "experts.down_proj": full.experts.down_proj[local],
        }
    )
    return moe
