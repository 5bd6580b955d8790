"""INT4 group-quantized weights as compressed-tensors' `pack-quantized` checkpoints store
them (Kimi-K2-Thinking's routed experts), for tests: the packing is the compressed-tensors
library's own, so a test reads what that library writes."""

from __future__ import annotations

import torch
from conftest import save_tiny_model
from deepseek_checkpoints import save_tiny_deepseek


def quantize_int4(
    w: torch.Tensor, group: int, pow2_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantization of w [..., N, K] in groups of `group` columns (the
    last one may be partial) -> (weight_packed [..., N, ceil(K / 8)] int32, weight_scale
    [..., N, ceil(K / group)] bfloat16), packed by compressed-tensors. pow2_scales: each
    scale the power of two at or above absmax / 7, so that every q * scale is a bfloat16
    value (compressed-tensors dequantizes into the scales' dtype)."""
    from compressed_tensors.compressors import pack_to_int32

    k = w.shape[-1]
    groups = -(-k // group)
    padded = torch.nn.functional.pad(w.float(), (0, groups * group - k))
    blocks = padded.unflatten(-1, (groups, group))
    scale = (blocks.abs().amax(-1) / 7).clamp_min(1e-8)
    if pow2_scales:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = scale.to(torch.bfloat16)
    q = (blocks / scale.float()[..., None]).round().clamp(-8, 7).flatten(-2)[..., :k]
    q = q.to(torch.int8)
    if q.dim() == 2:
        return pack_to_int32(q, 4), scale
    return torch.stack([pack_to_int32(m, 4) for m in q.reshape(-1, *q.shape[-2:])]).view(
        *q.shape[:-1], -1
    ), scale


KIMI_K2_THINKING_IGNORE = [  # its config.json's: only the routed experts are INT4
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
]


# the tiny checkpoints the INT4 tests pack, by name: (write the float checkpoint into a
# folder, which weights to pack, the ignore list): a Llama with every projection INT4, a
# DeepSeek-V3 with only its routed experts INT4 (Kimi-K2-Thinking's layout)
TINY_INT4 = {
    "llama": (lambda d: save_tiny_model(d, "LlamaForCausalLM"), lambda n: "proj" in n, None),
    "deepseek_v3": (
        lambda d: save_tiny_deepseek(d, first_k_dense_replace=1, n_shared_experts=1),
        lambda n: ".mlp.experts." in n,
        KIMI_K2_THINKING_IGNORE,
    ),
}


def quantization_config(group: int, ignore: list[str]) -> dict:
    """config.json's quantization_config of a compressed-tensors W4A16 checkpoint, as
    llm-compressor writes it (Kimi-K2-Thinking's, with its group size and ignore list)."""
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": group,
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    group_0 = {
        "targets": ["Linear"],
        "weights": weights,
        "input_activations": None,
        "output_activations": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": group_0},
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quantization_status": "compressed",
    }


def write_pack_quantized(
    path, plain, packs, group: int = 32, ignore=None, pow2_scales: bool = False
) -> int:
    """Rewrite the float checkpoint in `path` as pack-quantized INT4, and the same
    weights dequantized (float32) into the float checkpoint in `plain`: every
    "x.weight" for which packs(name) holds becomes x.weight_packed / x.weight_scale /
    x.weight_shape; config.json gets the quantization_config. Dequantized by
    compressed-tensors' own unpacking. Returns how many weights were packed (pow2_scales:
    see quantize_int4)."""
    import json
    from pathlib import Path

    from compressed_tensors.compressors import unpack_from_int32
    from safetensors.torch import load_file, save_file

    path, plain = Path(path), Path(plain)
    tensors = load_file(str(path / "model.safetensors"))
    packed_tensors, dequantized, count = {}, {}, 0
    for name, t in tensors.items():
        if not (name.endswith(".weight") and t.dim() == 2 and packs(name)):
            packed_tensors[name] = dequantized[name] = t
            continue
        packed, scale = quantize_int4(t, group, pow2_scales)
        base = name[: -len(".weight")]
        packed_tensors[base + ".weight_packed"] = packed
        packed_tensors[base + ".weight_scale"] = scale
        packed_tensors[base + ".weight_shape"] = torch.tensor(list(t.shape))
        q = unpack_from_int32(packed, 4, t.shape).float()
        s = scale.float().repeat_interleave(group, dim=-1)[:, : t.shape[1]]
        dequantized[name] = q * s
        count += 1
    save_file(packed_tensors, str(path / "model.safetensors"))
    save_file(dequantized, str(plain / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config(group, ignore or ["lm_head"])
    (path / "config.json").write_text(json.dumps(config))
    return count
