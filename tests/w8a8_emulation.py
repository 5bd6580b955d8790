"""An FP8 (W8A8) model's arithmetic done in torch, for a reference run of the same
precision as the Triton W8A8 path: every product the kernels compute from FP8 weights
(each FP8 `Linear` through `Fp8BlockMethod.apply`, and both GEMMs of FP8 routed experts)
takes its input rows rounded onto e4m3 exactly as kernels/fp8_quant.py defines it
(`quantize_groups_reference`: per row, groups of the weight block's width, scale = the
group's amax / 448 by true division, values rounded to nearest even), multiplies them
dequantized by the dequantized weight in float32, adds the bias in float32 and rounds
the sum once to the activations' dtype, as kernels/fp8_gemm.py and kernels/fp8_moe.py
do. Everything else (the plain layers: MLA's kv_b_proj, the router, lm_head; norms,
attention) runs as the engine runs it.

    emulation = W8A8Emulation(monkeypatch)   # before the LLM is built
    llm = LLM(model, enforce_eager=True, ...)  # the experts' loop reads offsets on the host

The routed experts take the reference loop (`routed_experts.grouped_mm_loop`, one
expert at a time) in every dtype: `fp8_experts.serves` answers False, so CUDA graphs
cannot capture the run (hence enforce_eager). `linears` and `experts` record which FP8
layers the emulation multiplied for, so a test can check that none was left out.
"""

from __future__ import annotations

import torch

from batchgen.kernels.fp8_quant import quantize_groups_reference
from batchgen.layers import routed_experts
from batchgen.layers.quant import fp8_experts
from batchgen.layers.quant.fp8 import Fp8BlockMethod
from batchgen.layers.quant.fp8_experts import Fp8Experts


def w8a8_product(
    x: torch.Tensor, weight: torch.Tensor, group: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] times weight^T (weight [N, K], dequantized), x's rows first rounded onto
    e4m3 in groups of `group` columns (quantize_groups_reference): float32 [..., N]."""
    rows = x.reshape(-1, x.shape[-1])
    q, scale = quantize_groups_reference(rows, group)
    a = q.float() * scale.repeat_interleave(group, dim=1)[:, : rows.shape[1]]
    out = a @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.view(*x.shape[:-1], weight.shape[0])


class W8A8Emulation:
    """Installs the emulation with `monkeypatch` (undone with it); see the module
    docstring. `linears`: the ids of the FP8 Linear layers it multiplied for;
    `experts`: the ids of the FP8 expert weights (gate_up and down separately)."""

    def __init__(self, monkeypatch) -> None:
        self.linears: set[int] = set()
        self.experts: set[int] = set()
        loop = routed_experts.grouped_mm_loop

        def apply(method, layer, x, bias):
            self.linears.add(id(layer))
            return w8a8_product(x, method.dense_weight(layer), method.block[1], bias).to(x.dtype)

        def grouped_loop(a, w, offs):
            if not isinstance(w, Fp8Experts):
                return loop(a, w, offs)
            self.experts.add(id(w.weight))
            out = a.new_empty(a.shape[0], w.shape[1])
            start = 0
            for g, end in enumerate(offs.tolist()):
                if end > start:
                    weight = w.expert(g, torch.float32)
                    out[start:end] = w8a8_product(a[start:end], weight, w.block[1]).to(a.dtype)
                start = end
            return out

        monkeypatch.setattr(Fp8BlockMethod, "apply", apply)
        monkeypatch.setattr(routed_experts, "grouped_mm_loop", grouped_loop)
        monkeypatch.setattr(fp8_experts, "serves", lambda x, w: False)
