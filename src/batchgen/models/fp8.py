"""Block-scaled FP8 checkpoints (DeepSeek-V3, Kimi-K2): weights dequantized at load.

Such a checkpoint stores a linear weight W [out, in] as float8_e4m3fn beside
`weight_scale_inv` [ceil(out / bo), ceil(in / bi)] float32, one scale per block of
bo x bi (config.json: `quantization_config = {"quant_method": "fp8",
"weight_block_size": [bo, bi], ...}`, 128 x 128 in DeepSeek-V3): the real weight is
W[i, j] * scale_inv[i // bo, j // bi]. batchgen computes in bf16 (or the dtype asked
for), so each pair becomes one plain weight as it is read, and the model never sees the
scales.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

SCALE_SUFFIX = "_scale_inv"  # "x.weight" -> "x.weight_scale_inv"
FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)


def block_size(config) -> tuple[int, int] | None:
    """The checkpoint's FP8 weight block (rows, columns), or None for an unquantized
    checkpoint; ValueError for a quantization batchgen does not load."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return None
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    method = quant.get("quant_method")
    block = quant.get("weight_block_size")
    if method != "fp8" or block is None:
        what = f"quant_method={method!r}" + ("" if block else ", no weight_block_size")
        raise ValueError(
            f"the checkpoint is quantized ({what}); batchgen loads unquantized weights "
            "and block-scaled FP8 (quant_method 'fp8' with weight_block_size)"
        )
    rows, cols = (int(b) for b in block)
    if rows < 1 or cols < 1:
        raise ValueError(f"quantization_config.weight_block_size must be positive, got {block}")
    return rows, cols


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]):
    """W * scale_inv per (rows x cols) block, in float32: weight [out, in] FP8,
    scale_inv [ceil(out / rows), ceil(in / cols)]. ValueError on a shape mismatch."""
    rows, cols = block
    out_dim, in_dim = weight.shape
    want = (-(-out_dim // rows), -(-in_dim // cols))
    if weight.dim() != 2 or tuple(scale_inv.shape) != want:
        raise ValueError(
            f"scale shape {tuple(scale_inv.shape)} does not match weight {tuple(weight.shape)} "
            f"in blocks of {rows}x{cols} (expected {want})"
        )
    w = weight.to(torch.float32)
    pad_out, pad_in = want[0] * rows - out_dim, want[1] * cols - in_dim
    if pad_out or pad_in:
        w = torch.nn.functional.pad(w, (0, pad_in, 0, pad_out))
    w = w.view(want[0], rows, want[1], cols) * scale_inv.to(torch.float32)[:, None, :, None]
    return w.view(want[0] * rows, want[1] * cols)[:out_dim, :in_dim]


def dequantized_weights(
    weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs with every FP8 weight and its
    `*_scale_inv` joined into one float32 weight (whichever of the two comes first is
    held until the other arrives; they may sit in different files). Other tensors pass
    through. ValueError naming a weight left without its scale, or a scale without
    its weight."""
    held_weights: dict[str, torch.Tensor] = {}
    held_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            weight = held_weights.pop(base, None)
            if weight is None:
                held_scales[base] = tensor
                continue
            yield base, _joined(base, weight, tensor, block)
        elif tensor.dtype in FP8_DTYPES:
            scale = held_scales.pop(name, None)
            if scale is None:
                held_weights[name] = tensor
                continue
            yield name, _joined(name, tensor, scale, block)
        else:
            yield name, tensor
    if held_weights or held_scales:
        lone = sorted(held_weights) or sorted(n + SCALE_SUFFIX for n in held_scales)
        what = "has no scale" if held_weights else "has no weight"
        raise ValueError(
            f"FP8 checkpoint: {lone[0]} {what}"
            + (f" (and {len(lone) - 1} more)" if len(lone) > 1 else "")
        )


def _joined(name: str, weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    try:
        return dequantize(weight, scale, block)
    except ValueError as e:
        raise ValueError(f"FP8 checkpoint weight {name}: {e}") from e
