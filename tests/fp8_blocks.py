"""Block-scaled FP8 weights as DeepSeek-V3's checkpoints store them, for tests."""

from __future__ import annotations

import torch


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
