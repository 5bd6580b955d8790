"""Block-scaled FP8 weights as DeepSeek-V3's checkpoints store them, for tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def quantize_blocks(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block absmax scaling to float8_e4m3fn (max 448), as DeepSeek's converter does."""
    rows, cols = block
    out_dim, in_dim = w.shape
    nb = (-(-out_dim // rows), -(-in_dim // cols))
    padded = torch.nn.functional.pad(w, (0, nb[1] * cols - in_dim, 0, nb[0] * rows - out_dim))
    blocks = padded.view(nb[0], rows, nb[1], cols)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(nb[0] * rows, nb[1] * cols)[:out_dim, :in_dim].contiguous(), scale


def quantize_checkpoint(path: Path, suffixes=("proj.weight",), quantize=quantize_blocks) -> None:
    """Rewrite the checkpoint in `path` in DeepSeek-V3's FP8 format: each weight whose
    name ends with one of `suffixes` as 128 x 128 blocks with their `_scale_inv`, and its
    config's quantization_config saying so. `quantize` (w, block) -> (FP8 weight, scale):
    this module's quantize_blocks unless a test asks for the package's own."""
    tensors = {}
    for name, t in load_file(str(path / "model.safetensors")).items():
        if name.endswith(tuple(suffixes)):
            tensors[name], tensors[name + "_scale_inv"] = quantize(t.float(), (128, 128))
        else:
            tensors[name] = t
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(config))
