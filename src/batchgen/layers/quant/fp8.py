"""Block-scaled FP8 weights kept in FP8 (DeepSeek-V3's and Kimi-K2's checkpoint format).

A weight W [out, in] is float8_e4m3fn beside `weight_scale_inv` [ceil(out / bo),
ceil(in / bi)] float32, one scale per bo x bi block (128 x 128 in those checkpoints):
the real weight is W[i, j] * scale_inv[i // bo, j // bi]. `Fp8BlockMethod` keeps both
in the layer and multiplies from them:

- CUDA (FP8 tensor cores: compute capability 8.9 and up), bfloat16 / float16
  activations: W8A8. The activations are quantized per token in
  groups of bi columns (kernels/fp8_quant.py) and one Triton GEMM (kernels/fp8_gemm.py)
  sums FP8 products in float32, scaled block by block.
- Everywhere else (the CPU; float32 activations): W8A16. The weight is dequantized one
  tile of rows at a time (`tile_rows`, whole blocks, about `tile_elements` values) into
  x's dtype and multiplied; only that tile is ever held dequantized. On float32 this is
  the product with the dequantized weight, which the CPU tests hold it to.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from batchgen.layers import batch_invariant
from batchgen.layers.quant.method import LinearMethod, QuantParam

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
TILE_ELEMENTS = 1 << 22  # weights dequantized at once on the tile path (16 MiB in float32)


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
        w = F.pad(w, (0, pad_in, 0, pad_out))
    w = w.view(want[0], rows, want[1], cols) * scale_inv.to(torch.float32)[:, None, :, None]
    return w.view(want[0] * rows, want[1] * cols)[:out_dim, :in_dim]


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [out, in] as (float8_e4m3fn weight, float32 scale_inv): each block's
    scale is its largest magnitude over 448, its values divided by it and rounded (the
    absmax scaling DeepSeek's converter and vLLM's fp8 option use)."""
    rows, cols = block
    out_dim, in_dim = w.shape
    nb = (-(-out_dim // rows), -(-in_dim // cols))
    padded = F.pad(w.float(), (0, nb[1] * cols - in_dim, 0, nb[0] * rows - out_dim))
    blocks = padded.view(nb[0], rows, nb[1], cols)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nb[0] * rows, nb[1] * cols)[:out_dim, :in_dim].contiguous(), scale


def tile_rows(block_rows: int, in_features: int, tile_elements: int = TILE_ELEMENTS) -> int:
    """Weight rows dequantized at once: whole blocks, about tile_elements values."""
    return max(1, tile_elements // max(1, in_features) // block_rows) * block_rows


def row_scales(
    scale_inv: torch.Tensor, rows: tuple[int, int], block_rows: int, unit_index=None
) -> torch.Tensor:
    """float32 [end - start, ceil(in / bi)]: each weight row's block scales, for rows
    [start, end); unit_index (Linear.unit_index) maps a row to its scale row where
    stacked shards start inside blocks, else row // block_rows."""
    start, end = rows
    if unit_index is None:
        index = torch.arange(start, end, device=scale_inv.device) // block_rows
    else:
        index = unit_index[start:end].long()
    return scale_inv.float().index_select(0, index)


def dequantize_rows(weight: torch.Tensor, scales: torch.Tensor, block_cols: int) -> torch.Tensor:
    """weight [rows, in] FP8 times each row's block scales [rows, ceil(in / bi)]: float32."""
    expanded = scales.repeat_interleave(block_cols, dim=1)[:, : weight.shape[1]]
    return weight.to(torch.float32) * expanded


def dequantized_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    tile_elements: int = TILE_ELEMENTS,
    unit_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """x W^T + bias with W held as FP8 blocks: each tile of rows dequantized into x's dtype
    (W * scale computed in float32, rounded once) and multiplied; x [..., in]. The
    products are batch_invariant.linear's (plain F.linear outside deterministic mode).
    unit_index: each row's scale row (Linear.unit_index), None: row // block rows."""
    out_dim, in_dim = weight.shape
    step = tile_rows(block[0], in_dim, tile_elements)
    if step >= out_dim and unit_index is None:
        return batch_invariant.linear(x, dequantize(weight, scale_inv, block).to(x.dtype), bias)
    out = x.new_empty(*x.shape[:-1], out_dim)
    for start in range(0, out_dim, step):
        end = min(start + step, out_dim)
        if unit_index is None:
            scales = scale_inv[start // block[0] : -(-end // block[0])]
            w = dequantize(weight[start:end], scales, block)
        else:
            scales = row_scales(scale_inv, (start, end), block[0], unit_index)
            w = dequantize_rows(weight[start:end], scales, block[1])
        part = None if bias is None else bias[start:end]
        out[..., start:end] = batch_invariant.linear(x, w.to(x.dtype), part)
    return out


def w8a8_serves(x: torch.Tensor) -> bool:
    """Whether Fp8BlockMethod.apply takes the W8A8 Triton path for x: 16-bit activations
    on a GPU with FP8 tensor cores (compute capability 8.9 and up: Ada, Hopper,
    Blackwell); elsewhere the tile-by-tile dequantized product."""
    return w8a8_serves_dtype(x.dtype, x.device)


def w8a8_serves_dtype(dtype: torch.dtype, device: torch.device | str) -> bool:
    """w8a8_serves for activations of `dtype` on `device`, before any exist."""
    device = torch.device(device)
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    return _fp8_tensor_cores(device.index or 0)


def _invariant_tuning():
    from batchgen.kernels.fp8_gemm import Fp8GemmTuning

    return Fp8GemmTuning(block_m=64, block_n=128, num_warps=4, num_stages=3, split_k=1)


@functools.cache
def _fp8_tensor_cores(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


class Fp8BlockMethod(LinearMethod):
    """A layer's weight as float8_e4m3fn `weight` [out, in] and float32
    `weight_scale_inv` [ceil(out / bo), ceil(in / bi)] (module docstring)."""

    name = "fp8"

    def __init__(self, block: tuple[int, int] = (128, 128)) -> None:
        rows, cols = (int(b) for b in block)
        if rows < 1 or cols < 1:
            raise ValueError(f"the FP8 weight block must be positive, got {block}")
        self.block = (rows, cols)

    def params(self) -> dict[str, QuantParam]:
        rows, cols = self.block
        return {
            "weight": QuantParam(torch.float8_e4m3fn),
            "weight_scale_inv": QuantParam(torch.float32, rows, cols),
        }

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        index = layer.unit_index("weight_scale_inv")
        if not w8a8_serves(x) or self.block[1] < 16 or self.block[1] & (self.block[1] - 1):
            w, scale = layer.weight, layer.weight_scale_inv
            return dequantized_linear(x, w, scale, self.block, bias, unit_index=index)
        from batchgen.kernels.fp8_gemm import block_scaled_mm
        from batchgen.kernels.fp8_quant import quantize_groups

        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        a, a_scale = quantize_groups(rows, self.block[1])
        # deterministic mode: one launch whatever the row count (no split of K)
        tuning = _invariant_tuning() if batch_invariant.active() else None
        out = block_scaled_mm(
            a, a_scale, layer.weight, layer.weight_scale_inv, self.block, x.dtype, bias,
            tuning=tuning, w_scale_rows=index,
        )  # fmt: skip
        return out.view(*x.shape[:-1], out.shape[-1])

    def dense_weight(self, layer) -> torch.Tensor:
        index = layer.unit_index("weight_scale_inv")
        if index is None:
            return dequantize(layer.weight, layer.weight_scale_inv, self.block)
        scales = row_scales(layer.weight_scale_inv, (0, layer.out_features), self.block[0], index)
        return dequantize_rows(layer.weight, scales, self.block[1])

    def quantize(self, layer, weight: torch.Tensor, rows: tuple[int, int] | None) -> None:
        """Each shard quantized in blocks from its own first row (Linear.unit_rows)."""
        if rows is None and layer.shards:
            for start, end in layer.shards.values():
                self.quantize(layer, weight[start:end], (start, end))
            return
        # on the layer's device: a GPU quantizes a checkpoint far faster than the host
        q, scale = quantize_blocks(weight.to(layer.weight.device), self.block)
        start, end = rows if rows is not None else (0, layer.out_features)
        first, last = layer.unit_rows(self.params()["weight_scale_inv"], rows)
        with torch.no_grad():
            layer.weight[start:end].copy_(q)
            layer.weight_scale_inv[first:last].copy_(scale)
