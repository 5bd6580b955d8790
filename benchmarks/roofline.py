"""The W1 roofline: every decode step reads all weights and all live KV once; prefill
runs at the matmul ceiling (BENCHMARKS.md)."""

from __future__ import annotations

from benchmarks.card import COPY_BW, MATMUL_FLOPS


def model_sizes(cfg: dict) -> tuple[float, float, float]:
    """(weight bytes read per decode step, KV bytes per token, matmul params per token)."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    attn = h * hd * (heads + 2 * kv_heads) + heads * hd * h
    mlp = 3 * h * inter
    per_layer = attn + mlp
    lm_head = cfg["vocab_size"] * h
    params = layers * per_layer + lm_head
    kv_per_token = 2 * layers * kv_heads * hd * 2
    return params * 2, kv_per_token, layers * per_layer


def roofline_seconds(
    cfg: dict,
    prompt_lens: list[int],
    out_lens: list[int],
    copy_bw: float = COPY_BW,
    matmul_flops: float = MATMUL_FLOPS,
) -> float:
    """Lower bound on wall time with all requests batched at once, on a card of the given
    ceilings (default: the H200's, card.py)."""
    weight_bytes, kv_tok, matmul_params = model_sizes(cfg)
    prefill = sum(2 * matmul_params * n for n in prompt_lens) / matmul_flops
    decode = 0.0
    for t in range(max(out_lens)):
        live = [p + t for p, o in zip(prompt_lens, out_lens) if o > t]
        decode += (weight_bytes + kv_tok * sum(live)) / copy_bw
    return prefill + decode
