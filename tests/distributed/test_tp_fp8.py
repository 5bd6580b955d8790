"""An FP8 DeepSeek-V3 checkpoint (128 x 128 blocks) at tensor_parallel_size=2 against
tensor_parallel_size=1: each rank keeps FP8 the layers whose slice is whole blocks (the
replicated latent projections, the dense MLP's features, its block of routed experts)
and generates what one process does: the same greedy tokens and finish reasons,
logprobs within 1e-4."""

from __future__ import annotations

import torch
from deepseek_checkpoints import save_tiny_deepseek
from fp8_blocks import quantize_checkpoint
from test_tp_deepseek import _assert_same, _generate


def _write_fp8(path) -> None:
    """A tiny DeepSeek-V3 checkpoint in DeepSeek-V3's FP8 format, 128 x 128 blocks."""
    save_tiny_deepseek(
        path, first_k_dense_replace=1, intermediate_size=256, moe_intermediate_size=128
    )
    quantize_checkpoint(path, ("proj.weight", "proj_with_mqa.weight"))


def test_tp2_keeps_whole_blocks_fp8_and_equals_tp1(tmp_path):
    _write_fp8(tmp_path)
    want, _ = _generate(str(tmp_path), num_kv_pages=200)
    got, llm = _generate(str(tmp_path), num_kv_pages=200, tensor_parallel_size=2)
    _assert_same(got, want)
    model = llm.engine.runner.model
    fp8 = torch.float8_e4m3fn
    assert model.layers[0].mlp.gate_up_proj.weight.dtype == fp8  # 128 of 256 features
    assert model.layers[0].self_attn.q_a_proj.weight.dtype == fp8  # replicated
    assert model.layers[1].mlp.experts.gate_up_proj.dtype == fp8  # experts 0-3
    assert model.layers[1].self_attn.o_proj.weight.dtype == torch.float32  # 48 columns


def test_expert_parallel_fp8_experts_equal_tp1(tmp_path):
    """enable_expert_parallel: tokens reach each rank's FP8 experts by all-to-all, and
    the run equals one process's."""
    _write_fp8(tmp_path)
    want, _ = _generate(str(tmp_path), num_kv_pages=200)
    got, llm = _generate(
        str(tmp_path), num_kv_pages=200, tensor_parallel_size=2, enable_expert_parallel=True
    )
    _assert_same(got, want)
    assert llm.engine.runner.model.layers[1].mlp.experts.down_proj_scale_inv.shape[0] == 4
