"""Random weights for load_format "dummy": a model built from config.json alone, with
the distribution of a freshly initialised transformers model (benchmarks and tests run
real shapes without a checkpoint), quantized layers included."""

from __future__ import annotations

import torch

from batchgen.models import fp8, pack_quantized


def init_dummy_weights(
    model: torch.nn.Module, seed: int = 0, dtype: torch.dtype | None = None, std: float = 0.02
) -> None:
    """Random weights in place, where the parameters already live (no host copy), as a
    transformers model initialised and then given normal(0, std) matrices: every weight
    of two or more dimensions (embeddings, projections, lm_head) from normal(0, std),
    norm weights 1, biases 0. The same seed, device and dtype give the same weights.
    A block-scaled FP8 weight gets normal(0, 1) values in float8_e4m3fn and its
    `*_scale_inv` the scale std, so that it too holds normal(0, std) weights; a packed
    INT4 one uniform nibbles and scales that give its values that std.
    With `dtype` (the model's), a matrix kept wider than it (DeepSeek-V3's float32
    router) holds values of `dtype`, as that model's checkpoints store it."""
    generators: dict[torch.device, torch.Generator] = {}

    def generator(device: torch.device) -> torch.Generator:  # one per device, seeded
        if device not in generators:
            generators[device] = torch.Generator(device).manual_seed(seed)
        return generators[device]

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(fp8.SCALE_SUFFIX):
                p.fill_(std)
            elif p.dtype in fp8.FP8_DTYPES:
                g = generator(p.device)
                values = torch.empty(p.shape, device=p.device).normal_(0.0, 1.0, generator=g)
                p.copy_(values.to(p.dtype))
            elif p.dtype == torch.int32:  # packed INT4 (pack_quantized): uniform nibbles
                g = generator(p.device)
                p.random_(-(2**31), 2**31 - 1, generator=g)
            elif name.endswith(pack_quantized.SCALE):  # q uniform in [-8, 7]: std 4.6
                p.fill_(std / 4.6)
            elif p.dim() >= 2:
                g = generator(p.device)
                p.normal_(0.0, std, generator=g)
                if dtype is not None and p.dtype != dtype and p.dtype.itemsize > dtype.itemsize:
                    p.copy_(p.to(dtype))
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
