"""INT4 group-quantized weights as compressed-tensors' `pack-quantized` checkpoints store
them (Kimi-K2-Thinking's routed experts), for tests: the packing is the compressed-tensors
library's own, so a test reads what that library writes."""

from __future__ import annotations

import torch


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantization of w [..., N, K] in groups of `group` columns (the
    last one may be partial) -> (weight_packed [..., N, ceil(K / 8)] int32, weight_scale
    [..., N, ceil(K / group)] bfloat16), packed by compressed-tensors."""
    from compressed_tensors.compressors import pack_to_int32

    k = w.shape[-1]
    groups = -(-k // group)
    padded = torch.nn.functional.pad(w.float(), (0, groups * group - k))
    blocks = padded.unflatten(-1, (groups, group))
    scale = (blocks.abs().amax(-1) / 7).clamp_min(1e-8).to(torch.bfloat16)
    q = (blocks / scale.float()[..., None]).round().clamp(-8, 7).flatten(-2)[..., :k]
    q = q.to(torch.int8)
    if q.dim() == 2:
        return pack_to_int32(q, 4), scale
    return torch.stack([pack_to_int32(m, 4) for m in q.reshape(-1, *q.shape[-2:])]).view(
        *q.shape[:-1], -1
    ), scale
