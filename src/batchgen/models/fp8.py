"""Block-scaled FP8 checkpoints (DeepSeek-V3, Kimi-K2): weights kept in FP8.

Such a checkpoint stores a linear weight W [out, in] as float8_e4m3fn beside
`weight_scale_inv` [ceil(out / bo), ceil(in / bi)] float32, one scale per block of
bo x bi (config.json: `quantization_config = {"quant_method": "fp8",
"weight_block_size": [bo, bi], ...}`, 128 x 128 in DeepSeek-V3): the real weight is
W[i, j] * scale_inv[i // bo, j // bi].

Before the model is allocated, `keep_fp8` gives every linear layer all of whose
checkpoint weights are FP8 an `Fp8BlockMethod` (layers/quant/fp8.py): it holds the pair
as stored and multiplies from it. The loader hands those layers the pairs as they are
(the scale under its own name, which the layer holds as `weight_scale_inv`), and joins
every other pair into one float32 weight as it reads (`dequantized_weights`): a layer
whose matrix the model reads itself (MLA's kv_b_proj), one whose shards are not all FP8,
and one whose tensor-parallel slice is not whole blocks. The routed experts
(`RoutedExperts.use_fp8`) stay FP8 the same way, when every expert of the rank's block
is FP8 and moe_intermediate_size is whole blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from batchgen.layers.linear import Linear
from batchgen.layers.quant.fp8 import Fp8BlockMethod, dequantize
from batchgen.layers.routed_experts import RoutedExperts

__all__ = ["block_size", "dequantize", "dequantized_weights", "keep_fp8", "quantize_linears"]

logger = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"  # "x.weight" -> "x.weight_scale_inv"
FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)
DEFAULT_BLOCK = (128, 128)  # quantization="fp8" on a float checkpoint, as DeepSeek-V3's


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


def keep_fp8(model: torch.nn.Module, fp8_weights: Iterable[str], block) -> set[str]:
    """Give every Linear of `model` (on meta) whose checkpoint weights (`fp8_weights`:
    the names of the checkpoint's FP8 weights) cover all of its shards an
    Fp8BlockMethod(block); returns those layers' weight names, which the loader then
    hands over as stored; the routed experts likewise (`use_fp8`). A layer that cannot
    hold them (not quantizable, a rank's slice not whole blocks) stays plain, its pairs
    dequantized."""
    by_layer: dict[int, tuple[torch.nn.Module, set, list[str]]] = {}
    for name in fp8_weights:
        try:
            target = model.checkpoint_target(name)
        except KeyError:
            continue
        if target is None or not _holds_fp8(*target[:2]):
            continue
        layer, param, shard = target
        entry = by_layer.setdefault(id(layer), (layer, set(), []))
        entry[1].add((param, shard))
        entry[2].append(name)
    method = Fp8BlockMethod(block)
    kept: set[str] = set()
    for layer, shards, names in by_layer.values():
        try:
            if isinstance(layer, RoutedExperts):
                wanted = {
                    (p, s) for p in ("gate_up_proj", "down_proj") for s in layer.shard_names(p)
                }
                if wanted <= shards:
                    layer.use_fp8(block)
            elif layer.quantizable and shards == {("weight", s) for s in layer.shards or [None]}:
                layer.use_method(method)
        except ValueError as e:
            logger.info("%s stays dequantized: %s", names[0], e)
        if getattr(layer, "quant", None) is not None or getattr(layer, "fp8_block", None):
            kept.update(names)
    return kept


def _holds_fp8(module: torch.nn.Module, param: str) -> bool:
    """Whether a checkpoint weight landing in `param` of `module` may stay FP8 there."""
    if isinstance(module, Linear):
        return param == "weight"
    return isinstance(module, RoutedExperts) and param in ("gate_up_proj", "down_proj")


def quantize_linears(model: torch.nn.Module, block=DEFAULT_BLOCK) -> int:
    """quantization="fp8": every quantizable Linear of `model` (on meta) gets an
    Fp8BlockMethod(block), and the routed experts are held in FP8 (`use_fp8`), their
    float weights quantized as they load (a layer whose rank's slice is not whole
    blocks stays plain). Returns how many layers did."""
    method = Fp8BlockMethod(block)
    count = 0
    for name, layer in model.named_modules():
        quantizable = isinstance(layer, Linear) and layer.quantizable
        if not quantizable and not isinstance(layer, RoutedExperts):
            continue
        try:
            if quantizable:
                layer.use_method(method)
            else:
                layer.use_fp8(block)
        except ValueError as e:
            logger.info("%s stays in the model's dtype: %s", name, e)
            continue
        count += 1
    return count


def dequantized_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    block: tuple[int, int],
    keep: frozenset[str] | set[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs with every FP8 weight and its
    `*_scale_inv` joined into one float32 weight (whichever of the two comes first is
    held until the other arrives; they may sit in different files), except the weights
    named in `keep` and their scales, which pass as they are. Other tensors pass
    through. ValueError naming a weight left without its scale, or a scale without
    its weight."""
    held_weights: dict[str, torch.Tensor] = {}
    held_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base in keep:
                yield name, tensor
                continue
            weight = held_weights.pop(base, None)
            if weight is None:
                held_scales[base] = tensor
                continue
            yield base, _joined(base, weight, tensor, block)
        elif tensor.dtype in FP8_DTYPES and name not in keep:
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
