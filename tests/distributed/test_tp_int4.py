"""An INT4 pack-quantized DeepSeek-V3 checkpoint (every linear layer packed, g32) at
tensor_parallel_size=2 against tensor_parallel_size=1: each rank keeps packed the layers
whose slice is whole words and groups (the replicated latent projections, q_b_proj's
heads, the dense MLP's features, its block of routed experts) and generates what one
process does: the same greedy tokens and finish reasons, logprobs within 1e-4."""

from __future__ import annotations

import torch
from deepseek_checkpoints import save_tiny_deepseek
from int4_blocks import write_pack_quantized
from test_tp_deepseek import _assert_same, _generate


def test_tp2_keeps_whole_groups_packed_and_equals_tp1(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    for d in (tmp_path, plain):
        save_tiny_deepseek(d, first_k_dense_replace=1, n_shared_experts=1)
    packed = write_pack_quantized(tmp_path, plain, lambda n: "proj" in n, 32)
    assert packed > 0
    want, _ = _generate(str(tmp_path), num_kv_pages=200)
    got, llm = _generate(str(tmp_path), num_kv_pages=200, tensor_parallel_size=2)
    _assert_same(got, want)
    model = llm.engine.runner.model
    assert model.layers[0].mlp.down_proj.weight_packed.dtype == torch.int32  # 64 of 128 columns
    assert model.layers[0].self_attn.q_a_proj.weight_packed.shape == (48, 8)  # replicated
    assert model.layers[1].mlp.experts.gate_up_proj_packed.shape[0] == 4  # experts 0-3
    assert model.layers[1].self_attn.o_proj.weight.dtype == torch.float32  # 48 columns
