"""INT4 weight-only checkpoints in compressed-tensors' `pack-quantized` format
(Kimi-K2-Thinking's: its routed experts INT4 in groups of 32, the rest bf16).

config.json:

    "quantization_config": {
      "quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
        "weights": {"num_bits": 4, "type": "int", "symmetric": true,
                    "strategy": "group", "group_size": 32, "actorder": null}}},
      "ignore": ["lm_head", "re:.*self_attn.*", ...]}

and for each quantized linear "x" the tensors x.weight_packed [out, in / 8] int32 (eight
4-bit values a word along the input dimension, kernels/int4_gemm.py), x.weight_scale
[out, in / group] and x.weight_shape [2] (the weight's [out, in]) in place of x.weight.

Before the model is allocated, `keep_int4` gives every layer all of whose checkpoint
weights are packed an INT4 form: a Linear `Int4Method` (layers/quant/int4.py), the routed
experts `RoutedExperts.use_int4`. The loader then hands those layers the packed words
and scales as stored (`int4_weights`: weight_shape checked against the packed tensor and
dropped) and joins the pairs of any other layer (one whose matrix the model reads
itself, MLA's kv_b_proj) into a float32 weight as it reads. Without a checkpoint
(load_format "dummy") `quantize_by_config` picks the layers from the config's targets and
ignore list instead.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from batchgen.kernels.int4_gemm import PACK, check_packed, dequantize_int4
from batchgen.layers.linear import Linear
from batchgen.layers.quant.int4 import Int4Method
from batchgen.layers.routed_experts import RoutedExperts

logger = logging.getLogger(__name__)

PACKED, SCALE, SHAPE = "_packed", "_scale", "_shape"  # "x.weight" + suffix
SUFFIXES = (PACKED, SCALE)  # the companions a kept layer takes as parameters
COMPANIONS = (PACKED, SCALE, SHAPE)  # every tensor stored in place of "x.weight"


@dataclass(frozen=True)
class Int4Scheme:
    """A pack-quantized checkpoint's one weight scheme: symmetric INT4 in groups of
    group_size input columns; targets / ignore as compressed-tensors matches them."""

    group_size: int
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()

    def ignores(self, names: Iterable[str]) -> bool:
        """Whether the ignore list names any of `names` (transformers module names):
        an equal name, or "re:" and a regex matching from the name's start."""
        return any(_matches(n, pattern) for n in names for pattern in self.ignore)


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


def _as_dict(quant) -> dict:
    if isinstance(quant, dict):
        return quant
    return quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)


def int4_scheme(config) -> Int4Scheme | None:
    """The checkpoint's INT4 scheme when config.json's quantization_config is
    compressed-tensors pack-quantized; None for any other (or none). ValueError naming
    what batchgen does not run: other bit widths, asymmetric or non-group weights,
    quantized activations, act-order group indices, several schemes."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return None
    quant = _as_dict(quant)
    if quant.get("quant_method") != "compressed-tensors":
        return None
    groups = quant.get("config_groups") or {}
    formats = {quant.get("format")} | {g.get("format") for g in groups.values()} - {None}
    if formats != {"pack-quantized"} or len(groups) != 1:
        raise ValueError(
            f"compressed-tensors checkpoint with format {sorted(map(str, formats))} and "
            f"{len(groups)} config groups: batchgen loads one pack-quantized INT4 group"
        )
    (group,) = groups.values()
    weights = group.get("weights") or {}
    wanted = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    off = {k: weights.get(k) for k, v in wanted.items() if weights.get(k) != v}
    if group.get("input_activations"):
        off["input_activations"] = "quantized"
    if weights.get("actorder") == "group":
        off["actorder"] = "group"
    size = weights.get("group_size")
    if not isinstance(size, int) or size < PACK or size % PACK:
        off["group_size"] = size
    if off:
        raise ValueError(
            f"compressed-tensors weights {off}: batchgen runs symmetric INT4 weights in "
            f"groups (a multiple of {PACK}) with unquantized activations (W4A16)"
        )
    return Int4Scheme(size, tuple(group.get("targets") or ()), tuple(quant.get("ignore") or ()))


def packed_names(names: Iterable[str]) -> set[str]:
    """The weight names ("x.weight") whose checkpoint tensors are packed."""
    return {n[: -len(PACKED)] for n in names if n.endswith(PACKED)}


def keep_int4(
    model: torch.nn.Module, weight_names: Iterable[str], scheme: Int4Scheme, dtype: torch.dtype
) -> set[str]:
    """Give every layer of `model` (on meta) whose checkpoint weights (`weight_names`:
    "x.weight" for each packed x) cover all of its shards an INT4 form, scales in
    `dtype`; returns those weight names, which the loader then hands over packed. A
    layer that cannot hold them (not quantizable, a shard off a group) stays plain, its
    weights dequantized as they load."""
    by_layer: dict[int, tuple[torch.nn.Module, set, list[str]]] = {}
    for name in weight_names:
        try:
            target = model.checkpoint_target(name)
        except KeyError:
            continue
        if target is None:
            continue
        layer, param, shard = target
        entry = by_layer.setdefault(id(layer), (layer, set(), []))
        entry[1].add((param, shard))
        entry[2].append(name)
    kept: set[str] = set()
    for layer, filled, names in by_layer.values():
        if _give_int4(layer, filled, scheme.group_size, dtype, names[0]):
            kept.update(names)
    return kept


def _give_int4(layer, filled: set, group_size: int, dtype, first: str) -> bool:
    if isinstance(layer, RoutedExperts):
        wanted = {(p, s) for p in ("gate_up_proj", "down_proj") for s in layer.shard_names(p)}
        if not wanted <= filled:
            logger.info("%s: not every expert is packed; the experts stay dequantized", first)
            return False
        layer.use_int4(group_size, dtype)
        return True
    if not isinstance(layer, Linear) or not layer.quantizable:
        return False
    if {s for p, s in filled if p == "weight"} != (set(layer.shards) or {None}):
        return False
    try:
        layer.use_method(Int4Method(group_size, dtype))
    except ValueError as e:
        logger.info("%s stays dequantized: %s", first, e)
        return False
    return True


def quantize_by_config(model: torch.nn.Module, scheme: Int4Scheme, dtype: torch.dtype) -> int:
    """load_format "dummy": the layers a checkpoint of this config would hold packed
    get an INT4 form (scales in `dtype`): every quantizable Linear and the routed
    experts, less those the ignore list names (matched on transformers' names: "model."
    and the module's path, a stacked layer's checkpoint parts, an expert's projections).
    Returns how many layers did."""
    if "Linear" not in scheme.targets:
        raise ValueError(f"compressed-tensors targets {list(scheme.targets)}: only 'Linear'")
    stacked = {shard: part for part, (_, shard) in getattr(model, "stacked", {}).items()}
    count = 0
    for path, layer in model.named_modules():
        name = "model." + path
        if isinstance(layer, RoutedExperts):
            experts = [
                f"{name}.{layer.local_experts.start}.{p}_proj" for p in ("gate", "up", "down")
            ]
            if not scheme.ignores(experts):
                layer.use_int4(scheme.group_size, dtype)
                count += 1
        elif isinstance(layer, Linear) and layer.quantizable:
            parent = name.rpartition(".")[0]
            names = [name] + [f"{parent}.{stacked[s]}" for s in layer.shards if s in stacked]
            if scheme.ignores(names):
                continue
            try:
                layer.use_method(Int4Method(scheme.group_size, dtype))
            except ValueError as e:
                logger.info("%s stays in the model's dtype: %s", path, e)
                continue
            count += 1
    return count


def int4_weights(
    weights: Iterable[tuple[str, torch.Tensor]], group_size: int, keep: frozenset[str] | set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs with each packed weight's tensors as its
    layer takes them: for a weight in `keep` "x.weight_packed" and "x.weight_scale" as
    stored; for any other the pair joined into one float32 "x.weight" (whichever comes
    first held until the other arrives; in_features 8 times the packed words).
    "x.weight_shape" is checked against the packed tensor's shape and dropped. Other
    tensors pass through. ValueError naming a packed weight left without its scale, a
    scale without its packed weight, or a weight_shape its packed tensor does not fit."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    packed_shapes: dict[str, tuple[int, ...]] = {}  # shapes only: no tensor kept
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in weights:
        suffix = next((s for s in (PACKED, SCALE, SHAPE) if name.endswith(s)), None)
        base = name[: -len(suffix)] if suffix else ""
        if suffix is None or not base.endswith("weight"):
            yield name, tensor
            continue
        if suffix == SHAPE:
            shapes[base] = tuple(int(v) for v in tensor.tolist())
        elif suffix == PACKED:
            packed_shapes[base] = tuple(tensor.shape)
        if base in shapes and base in packed_shapes:
            _check_shape(base, packed_shapes.pop(base), shapes.pop(base))
        if suffix == SHAPE:
            continue
        if base in keep:
            yield name, tensor
            continue
        parts = held.setdefault(base, {})
        parts[suffix] = tensor
        if len(parts) == 2:
            del held[base]
            yield base, _joined(base, parts, group_size)
    if held:
        lone = sorted(held)
        what = "has no scale" if PACKED in held[lone[0]] else "has no packed weight"
        raise ValueError(
            f"pack-quantized checkpoint: {lone[0]} {what}"
            + (f" (and {len(lone) - 1} more)" if len(lone) > 1 else "")
        )


def _check_shape(base: str, packed: tuple[int, ...], shape: tuple[int, ...]) -> None:
    """ValueError unless the packed words hold a weight of weight_shape [out, in]."""
    if len(shape) != 2 or tuple(packed) != (shape[0], -(-shape[1] // PACK)):
        raise ValueError(
            f"pack-quantized checkpoint weight {base}: packed {list(packed)} does not "
            f"hold weight_shape {list(shape)}"
        )


def _joined(base: str, parts: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    packed, scale = parts[PACKED], parts[SCALE]
    try:
        check_packed(packed, scale, packed.shape[-1] * PACK, group_size)
    except ValueError as e:
        raise ValueError(f"pack-quantized checkpoint weight {base}: {e}") from e
    return dequantize_int4(packed, scale, packed.shape[-1] * PACK, group_size)
