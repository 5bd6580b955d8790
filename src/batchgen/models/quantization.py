"""Which layers of a model hold quantized weights, decided on the meta device before the
model is allocated (so a layer's quantized parameters are all that is ever allocated):

- a checkpoint whose config.json has a `quantization_config` (block-scaled FP8,
  models/fp8.py; INT4 pack-quantized, models/pack_quantized.py) keeps its quantized
  weights as stored in every layer that can hold them; the rest are dequantized as they
  load;
- EngineConfig.quantization ("fp8") quantizes a float checkpoint's linear layers as
  their weights load (block-scaled FP8, 128 x 128 blocks, as vLLM's option does);
- load_format "dummy" gives the layers the checkpoint or option would quantize random
  quantized weights.

`plan_quantization` returns a `QuantPlan`: the checkpoint weights the loader hands to
their layers as stored, and the suffixes of their companion tensors ("x.weight" ->
"x.weight_scale_inv"; INT4: "x.weight_packed", "x.weight_scale"), which the loader gives to the weight's layer as the parameter of
the weight's name plus the suffix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from batchgen.config_groups import QUANTIZATIONS
from batchgen.models import fp8, pack_quantized


@dataclass(frozen=True)
class QuantPlan:
    """kept: checkpoint weight names handed to their layers as stored; suffixes: the
    names of their companion tensors (weight name + suffix)."""

    kept: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()

    def companion(self, name: str) -> tuple[str, str] | None:
        """(weight name, suffix) when `name` is a kept weight's companion tensor."""
        for suffix in self.suffixes:
            if name.endswith(suffix) and name[: -len(suffix)] in self.kept:
                return name[: -len(suffix)], suffix
        return None


def plan_quantization(
    model: torch.nn.Module,
    config,
    quantization: str | None,
    tensor_names: Callable[[], Iterable[str]] | None,
    dtype: torch.dtype | None = None,
) -> QuantPlan:
    """Give `model`'s layers (on meta) their quantized forms; `tensor_names` lists the
    checkpoint's tensors (None: no checkpoint is read, load_format "dummy"); `dtype`:
    the model's, in which INT4 scales are held (None: bfloat16). ValueError for a
    quantization batchgen does not run."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}"
        )
    scheme = pack_quantized.int4_scheme(config)
    if scheme is not None:  # INT4 pack-quantized (compressed-tensors)
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} on an INT4 pack-quantized checkpoint")
        scale_dtype = dtype or torch.bfloat16
        if tensor_names is None:
            pack_quantized.quantize_by_config(model, scheme, scale_dtype)
            return QuantPlan()
        packed = pack_quantized.packed_names(tensor_names())
        kept = pack_quantized.keep_int4(model, packed, scheme, scale_dtype)
        return QuantPlan(frozenset(kept), pack_quantized.SUFFIXES)
    block = fp8.block_size(config)
    if block is None:
        if quantization == "fp8":
            fp8.quantize_linears(model)
        return QuantPlan()
    if tensor_names is None:
        fp8.quantize_linears(model, block)
        return QuantPlan()
    suffix = fp8.SCALE_SUFFIX
    kept = fp8.keep_fp8(
        model, [n[: -len(suffix)] for n in tensor_names() if n.endswith(suffix)], block
    )
    return QuantPlan(frozenset(kept), (fp8.SCALE_SUFFIX,))
