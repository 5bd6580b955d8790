"""A checkpoint's FP8 KV-cache scales (kv_cache_dtype "fp8"), and how attention uses them.

Checkpoints calibrated for an FP8 KV cache (llm-compressor / compressed-tensors, NVIDIA
ModelOpt, AutoFP8) ship, per attention layer, the scale that maps K and V into e4m3's
range. With them an FP8 page holds

    write:  cache = e4m3(clamp(x / scale, -448, 448))
    read:   x' = float(cache) * scale

Their names, under a layer's `model.layers.N.self_attn.`:

    k_scale, v_scale                  compressed-tensors, vLLM
    k_proj.k_scale, v_proj.v_scale    ModelOpt
    kv_scale                          AutoFP8 (one scale for K and V)

Each is one value (per tensor) or one per KV head of the whole model (every rank's);
anything else (another count, a value not finite or not above 0) is a ValueError naming
the tensor. A layer whose checkpoint ships none keeps 1.0 (as vLLM does). With
kv_cache_dtype "auto" the pages hold the compute dtype and the scales are not used.

MLA layers (DeepSeek-V3, Kimi) store one latent a token: it takes k_scale (or kv_scale),
per tensor; a v_scale beside it is checked and not used (vLLM's MLA does the same).

No kernel reads a scale: attention folds them where it costs nothing. K and V are
divided before the store (in float32, so the e4m3 rounding is the only one); the key
scale multiplies the softmax scale (q . k's = s (q . k')), per head by scaling the
query's heads instead (in q's dtype: one more rounding, 2^-9 relative in bf16, far
below e4m3's 2^-4); the value scale multiplies the output (sum p v's = s sum p v').
"""

from __future__ import annotations

import re

import torch

# the checkpoint names, after "self_attn.": which scale each fills ("kv": both)
_NAMES = {
    "k_scale": "k",
    "v_scale": "v",
    "kv_scale": "kv",
    "k_proj.k_scale": "k",
    "v_proj.v_scale": "v",
}
_SCALE_NAME = re.compile(r"(.*\.self_attn)\.(" + "|".join(map(re.escape, _NAMES)) + r")$")


def split_name(name: str) -> tuple[str, str] | None:
    """(the attention module's dotted path, "k" | "v" | "kv") for a KV-scale checkpoint
    name ("layers.3.self_attn.k_proj.k_scale" -> ("layers.3.self_attn", "k")), else None."""
    match = _SCALE_NAME.fullmatch(name)
    return None if match is None else (match[1], _NAMES[match[2]])


class KVScales:
    """One layer's K and V scales: per KV head, this rank's `num_heads` of the model's
    `total_heads` starting at `first_head`. 1.0 until `load` gives a checkpoint's."""

    def __init__(self, num_heads: int, first_head: int = 0, total_heads: int | None = None):
        self.num_heads = num_heads
        self.first_head = first_head
        self.total_heads = num_heads if total_heads is None else total_heads
        # on the host whatever device the model is built on (meta, while loading)
        self.k = torch.ones(num_heads, dtype=torch.float32, device="cpu")
        self.v = torch.ones(num_heads, dtype=torch.float32, device="cpu")
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        # the value every head shares (None: heads differ), kept for the forward
        self.k_shared: float | None = 1.0
        self.v_shared: float | None = 1.0
        self.unit = True  # every scale 1.0: nothing to fold

    def load(self, which: str, tensor: torch.Tensor) -> None:
        """Fill the "k", "v" or "kv" (both) scale from a checkpoint tensor: one value or
        one per KV head of the model. ValueError for any other tensor."""
        values = tensor.detach().float().cpu().reshape(-1)
        if tensor.dim() > 1 or values.numel() not in (1, self.total_heads):
            per_head = f" or {self.total_heads} (one per KV head)" if self.total_heads > 1 else ""
            raise ValueError(
                f"a KV-cache scale holds 1 value (per tensor){per_head}, got shape "
                f"{tuple(tensor.shape)}"
            )
        if not (torch.isfinite(values).all() and (values > 0).all()):
            raise ValueError(f"a KV-cache scale must be finite and above 0, got {values.tolist()}")
        if values.numel() > 1:
            values = values[self.first_head : self.first_head + self.num_heads]
        values = values.expand(self.num_heads).clone()
        if which in ("k", "kv"):
            self.k = values
        if which in ("v", "kv"):
            self.v = values
        self._on_device.clear()
        self.k_shared, self.v_shared = _shared(self.k), _shared(self.v)
        self.unit = self.k_shared == 1.0 and self.v_shared == 1.0

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) per head on `device`, copied once (the first, eager, forward)."""
        if device not in self._on_device:
            self._on_device[device] = (self.k.to(device), self.v.to(device))
        return self._on_device[device]


def _shared(scales: torch.Tensor) -> float | None:
    """The one value every head's scale has, or None when heads differ."""
    first = float(scales[0])
    return first if bool((scales == first).all()) else None


def divide(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, D] / scales [Hkv] per head, in float32 (what the FP8 store rounds)."""
    return x.float() / scales[:, None]


def per_query_head(scales: torch.Tensor, num_heads: int) -> torch.Tensor:
    """KV-head scales [Hkv] -> one per query head [H] (GQA: a group shares its KV head)."""
    return scales.repeat_interleave(num_heads // scales.numel())[:, None]
