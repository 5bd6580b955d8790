"""Tiny checkpoints whose K and V (MLA: the latent) run about 1000 times FP8's largest
value while the model computes the same function, with the KV scales that bring them
back into e4m3's range (layers/kv_scales.py), under each format's names: shared by
tests/engine/test_kv_fp8_scales.py and tests/distributed/test_tp_kv_scales.py."""

from __future__ import annotations

import json

import torch
from conftest import save_tiny_model
from deepseek_checkpoints import save_tiny_deepseek
from safetensors.torch import load_file, save_file

BIG = 1000.0


def grown_qwen3(path) -> tuple[dict, dict]:
    """(weights, scales): Qwen3's k_norm and v_proj grown by BIG, q_norm and o_proj
    shrunk by it; scales per tensor and per head, compressed-tensors' and ModelOpt's names."""
    save_tiny_model(path, "Qwen3ForCausalLM")
    t = load_file(str(path / "model.safetensors"))
    for i in range(2):
        a = f"model.layers.{i}.self_attn."
        t[a + "k_norm.weight"] = t[a + "k_norm.weight"] * BIG
        t[a + "q_norm.weight"] = t[a + "q_norm.weight"] / BIG
        t[a + "v_proj.weight"] = t[a + "v_proj.weight"] * BIG
        t[a + "o_proj.weight"] = t[a + "o_proj.weight"] / BIG
    return t, {
        "model.layers.0.self_attn.k_scale": torch.tensor(BIG / 64),  # compressed-tensors
        "model.layers.0.self_attn.v_scale": torch.tensor([BIG / 32, BIG / 64]),  # per head
        "model.layers.1.self_attn.k_proj.k_scale": torch.tensor([BIG / 48, BIG / 64]),
        "model.layers.1.self_attn.v_proj.v_scale": torch.tensor([BIG / 40]),  # ModelOpt
    }


def grown_deepseek(path) -> tuple[dict, dict]:
    """(weights, scales): DeepSeek-V3's latent (c_kv and k_pe) grown by BIG, kv_b_proj and
    q_b_proj's rope rows shrunk by it; a kv_scale for the
    first layer, a k_scale (and a v_scale MLA does not use) for the second."""
    save_tiny_deepseek(path, first_k_dense_replace=1)
    config = json.loads((path / "config.json").read_text())
    heads, nope, rope = (
        config[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim")
    )
    rank = config["kv_lora_rank"]
    t = load_file(str(path / "model.safetensors"))
    for i in range(2):
        a = f"model.layers.{i}.self_attn."
        t[a + "kv_a_layernorm.weight"] = t[a + "kv_a_layernorm.weight"] * BIG
        t[a + "kv_b_proj.weight"] = t[a + "kv_b_proj.weight"] / BIG
        kv_a = t[a + "kv_a_proj_with_mqa.weight"].clone()
        kv_a[rank:] *= BIG
        t[a + "kv_a_proj_with_mqa.weight"] = kv_a
        q_b = t[a + "q_b_proj.weight"].clone().view(heads, nope + rope, -1)
        q_b[:, nope:] /= BIG
        t[a + "q_b_proj.weight"] = q_b.reshape(heads * (nope + rope), -1)
    return t, {
        "model.layers.0.self_attn.kv_scale": torch.tensor([BIG / 64]),
        "model.layers.1.self_attn.k_scale": torch.tensor(BIG / 48),
        "model.layers.1.self_attn.v_scale": torch.tensor(3.0),
    }


def write_weights(path, tensors) -> str:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return str(path)
