"""FP8 KV pages with per-head checkpoint KV scales (layers/kv_scales.py) under tensor
parallel on gloo: each rank holds one of the tiny Qwen3's two KV heads and takes that
head's scale (a rank reading another head's would misread every K or V it stores), and
tensor_parallel_size=2 generates what one process does: the same greedy tokens and
finish reasons, logprobs within 1e-4."""

from __future__ import annotations

from kv_scale_checkpoints import grown_qwen3, write_weights
from test_tp_deepseek import _assert_same, _generate


def test_tp2_cuts_per_head_kv_scales_and_equals_tp1(tmp_path):
    tensors, scales = grown_qwen3(tmp_path)
    assert any(s.numel() == 2 for s in scales.values())  # per head: one a rank
    write_weights(tmp_path, {**tensors, **scales})
    want, _ = _generate(str(tmp_path), num_kv_pages=200, kv_cache_dtype="fp8")
    got, llm = _generate(
        str(tmp_path), num_kv_pages=200, kv_cache_dtype="fp8", tensor_parallel_size=2
    )
    _assert_same(got, want)
    attn = llm.engine.runner.model.layers[1].self_attn.attn
    assert attn.kv_scales.k.tolist() == [
        scales["model.layers.1.self_attn.k_proj.k_scale"][0].item()
    ]
