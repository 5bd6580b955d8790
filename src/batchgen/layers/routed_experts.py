"""The routed experts of a mixture-of-experts layer: stacked weights, token-sorted math.

Routed experts are computed token-sorted (rows of [T * top_k] sorted by expert id, group
offsets from a scatter-add, no host synchronisation) and then multiplied group by group:

- GPU path: `torch._grouped_mm` (bfloat16 on Hopper/Blackwell, see grouped_mm_available):
  two grouped GEMMs on fixed shapes, nothing read back to the host, so a decode step can
  be captured in a CUDA graph.
- Reference path (everywhere else, the CPU in particular): the same sorted rows, one
  matmul per expert that has rows; it reads the group offsets on the host (`tolist`), so
  it cannot be captured.

Both paths add a token's top_k expert outputs in float32, in a fixed order, without
atomics: the same inputs give the same bits on every run. On CUDA the sum is one kernel
(kernels/moe_combine.py) that reads each pair's row where the GEMMs left it, through the
inverse of the sort; elsewhere the torch reference of it.

Expert parallel: a rank holds a contiguous block of the experts; pairs routed to other
blocks sort into a last group no GEMM computes and add nothing:

    sorted pairs:  | block expert 0 | block expert 1 | ... | outside the block |
    offs:                         ^ offs[0]        ^ offs[1]   ^ offs[-1] (<= T * top_k)

INT4 experts (`RoutedExperts.use_int4`, a compressed-tensors pack-quantized checkpoint):
the weights stay packed (layers/int4_experts.py) and go where a stacked weight
goes; on CUDA the two GEMMs are kernels/int4_moe.py's, elsewhere one expert at a time is
dequantized and multiplied.
"""

from __future__ import annotations

import torch
from torch import nn

from batchgen.kernels.fused_moe import TUNING, MoETuning, align_pairs, moe_gemm, sort_by_group
from batchgen.kernels.moe_combine import moe_combine, moe_combine_reference
from batchgen.layers import batch_invariant
from batchgen.layers.activation import silu_and_mul
from batchgen.layers.int4_experts import (
    PackedExperts,
    expert_gemm,
    packed_shapes,
)
from batchgen.layers.int4_experts import moe_tuning as int4_moe_tuning
from batchgen.layers.quant import fp8_experts
from batchgen.layers.quant.fp8_experts import Fp8Experts
from batchgen.layers.tp_group import TPGroup


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` serves x without a host sync: bfloat16 on a CUDA device
    of compute capability 9.x or 10.x (Hopper, Blackwell), a torch that has the op. On other
    GPUs the op falls back to a loop that copies the offsets to the host."""
    return grouped_mm_serves(x.dtype, x.device)


def grouped_mm_serves(dtype: torch.dtype, device: torch.device | str) -> bool:
    """grouped_mm_available for activations of `dtype` on `device`, before any exist."""
    device = torch.device(device)
    if not (hasattr(torch, "_grouped_mm") and device.type == "cuda" and dtype == torch.bfloat16):
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def grouped_mm_loop(a: torch.Tensor, w, offs: torch.Tensor) -> torch.Tensor:
    """Rows a[offs[g-1]:offs[g]] times w[g]^T for each group g: [M, K] x [G, N, K] -> [M, N]
    (w a tensor, or PackedExperts: one expert dequantized at a time). Reference path:
    reads offs on the host."""
    out = a.new_empty(a.shape[0], w.shape[1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:  # INT4 or FP8 experts: each dequantized in turn into a's dtype
            weight = w[g] if isinstance(w, torch.Tensor) else w.expert(g, a.dtype)
            out[start:end] = batch_invariant.linear(a[start:end], weight)
        start = end
    return out


def grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """As grouped_mm_loop, in one `torch._grouped_mm` launch (w^T is column-major per
    group, as the op wants). No host synchronisation."""
    return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)


def _expert_gemm(a, w, aligned, num_pairs: int, rows_per_token: int, tuning: MoETuning):
    if isinstance(w, PackedExperts):
        return expert_gemm(a, w, aligned, num_pairs, rows_per_token, tuning)
    if isinstance(w, Fp8Experts):
        return fp8_experts.fp8_expert_gemm(a, w, aligned, num_pairs, rows_per_token, tuning)
    return moe_gemm(a, w, *aligned, num_pairs, rows_per_token, tuning)


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor | PackedExperts,
    down: torch.Tensor | PackedExperts,
    weights: torch.Tensor,
    ids: torch.Tensor,
    use_grouped_mm: bool | None = None,
    first_expert: int | None = None,
    triton_moe: MoETuning | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for x [T, H], gate_up [E, 2I, H]
    (gate rows, then up rows), down [E, H, I], weights [T, k], ids [T, k] -> [T, H] in
    x's dtype. use_grouped_mm None: the GPU path where grouped_mm_available(x) and the
    rows are 16-byte aligned (H and I multiples of 8), else the reference path.
    gate_up and down may be PackedExperts (INT4) or Fp8Experts (block-scaled FP8): the
    grouped-GEMM path does not take them; triton_moe runs kernels/int4_moe.py or
    kernels/fp8_moe.py, the reference path dequantizes an expert at a time.

    With first_expert (expert parallel: one rank's block) gate_up[e] and down[e] are
    expert first_expert + e, and a pair routed to an expert outside the block adds
    nothing: such pairs sort last, past every group's rows, so no GEMM computes them,
    and their rows are masked out (not multiplied by 0: they hold whatever the GEMM left
    there). None: every expert is here, and nothing is masked.

    triton_moe: the two GEMMs as kernels/fused_moe.py's Triton kernels with that launch,
    which read and write rows through the sorted pair ids (no gather or scatter beside
    them); not the engine's path until benchmarks/bench_kernels.py --moe shows it faster.

    residual [T, H] (x's dtype; the shared experts' output) is added to the sum in the
    same pass on CUDA (moe_combine), as `sum + residual` in x's dtype would."""
    t, k = ids.shape
    num_experts = gate_up.shape[0]
    outside = None
    if first_expert is None:
        flat = ids.reshape(-1)
    else:
        local = ids - first_expert
        outside = (local < 0) | (local >= num_experts)
        flat = local.masked_fill(outside, num_experts).reshape(-1)  # group E: nobody's
    if triton_moe is not None:
        aligned = align_pairs(flat, num_experts, triton_moe.block_m)
        h = _expert_gemm(x.contiguous(), gate_up, aligned, t * k, k, triton_moe)
        h = _expert_gemm(silu_and_mul(h), down, aligned, t * k, 1, triton_moe)
        position = torch.arange(t * k, device=x.device)  # h is in pair order already
    else:
        if use_grouped_mm is None:
            aligned = x.shape[1] % 8 == 0 and down.shape[2] % 8 == 0
            plain = isinstance(gate_up, torch.Tensor)
            use_grouped_mm = aligned and plain and grouped_mm_available(x)
        order = sort_by_group(flat, num_experts + 1)[1]  # sorted row r is pair order[r]
        counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts[:num_experts], 0, dtype=torch.int32)  # each group's end
        rows = x.index_select(0, order // k)
        mm = grouped_mm if use_grouped_mm else grouped_mm_loop
        h = mm(silu_and_mul(mm(rows, gate_up, offs)), down, offs)
        position = torch.empty_like(order).index_copy_(
            0, order, torch.arange(t * k, device=x.device)
        )
    weights = weights.float()
    if outside is not None:
        weights = weights.masked_fill(outside, 0.0)
    if x.is_cuda:  # one pass over h: no copy back to pair order, no float32 copy of it
        return moe_combine(h, position, weights.contiguous(), residual=residual)
    return moe_combine_reference(h, position, weights, residual)


class RoutedExperts(nn.Module):
    """The routed experts' weights, stacked: gate_up_proj [E, 2I, H] (expert e's
    gate_proj rows, then its up_proj rows) and down_proj [E, H, I], transformers 5's
    layout and names.

    `load(param, tensor, shard)` fills them from a checkpoint: shard None copies a whole
    fused tensor; shard "{e}.gate" / "{e}.up" (param gate_up_proj) and "{e}.down" (param
    down_proj) copy one expert's per-expert tensor. `shard_names(param)` lists them all,
    `holds(shard)` says whether a shard is this rank's (the loader reads no other).

    With `tp` (expert parallel) this rank holds the contiguous block of E / size experts
    `local_experts` = range(rank * E / size, (rank + 1) * E / size), stacked in that
    order; `load` still takes the checkpoint's expert ids and whole fused tensors and
    keeps its block's (another block's expert is skipped), and forward adds only its
    experts' contributions (the caller sums the ranks').

    `use_int4(group_size, scale_dtype)` (on meta, before the model is allocated) holds
    the experts as INT4 instead: gate_up_proj_packed / gate_up_proj_scale and
    down_proj_packed / down_proj_scale (packed [E, N, K / 8] int32, scales [E, N, K /
    group]), filled by the same shards from a pack-quantized checkpoint's
    `weight_packed` / `weight_scale` tensors. `use_fp8(block)` holds them as
    block-scaled FP8: gate_up_proj / down_proj in float8_e4m3fn beside
    gate_up_proj_scale_inv / down_proj_scale_inv ([E, ceil(N / bn), ceil(K / bk)]),
    filled by the same shards from an FP8 checkpoint's weights and `weight_scale_inv`
    (a float weight given to them is quantized as it loads)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        dtype=None,
        device=None,
        tp: TPGroup | None = None,
    ):
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.group_size: int | None = None  # INT4 groups (use_int4); None: plain weights
        self.fp8_block: tuple[int, int] | None = None  # FP8 weight blocks (use_fp8)
        num_local = num_experts if tp is None else tp.split(num_experts, "n_routed_experts")
        first = 0 if tp is None else tp.rank * num_local
        self.local_experts = range(first, first + num_local)
        self.holds_all = num_local == num_experts  # nothing routed elsewhere to mask
        factory = {"dtype": dtype, "device": device}
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_local, 2 * inter, hidden, **factory), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_local, hidden, inter, **factory), requires_grad=False
        )

    def use_int4(self, group_size: int, scale_dtype: torch.dtype) -> None:
        """Hold the experts' weights as INT4 (class docstring); call on meta."""
        device = self.gate_up_proj.device
        num_local = len(self.local_experts)
        del self.gate_up_proj, self.down_proj
        for name, rows, k in (
            ("gate_up_proj", 2 * self.inter, self.hidden),
            ("down_proj", self.hidden, self.inter),
        ):
            packed, scale = packed_shapes(num_local, rows, k, group_size)
            for suffix, shape, dtype in (
                ("_packed", packed, torch.int32),
                ("_scale", scale, scale_dtype),
            ):
                tensor = torch.empty(shape, dtype=dtype, device=device)
                self.register_parameter(name + suffix, nn.Parameter(tensor, requires_grad=False))
        self.group_size = group_size

    def use_fp8(self, block: tuple[int, int]) -> None:
        """Hold the experts' weights as block-scaled FP8 (class docstring); call on meta.
        ValueError (nothing changed) unless the up rows start on a block."""
        if self.inter % block[0]:
            raise ValueError(
                f"moe_intermediate_size {self.inter} is not whole {block[0]}-row blocks"
            )
        device, num_local = self.gate_up_proj.device, len(self.local_experts)
        for name in ("gate_up_proj", "down_proj"):
            shape = getattr(self, name).shape
            scale = fp8_experts.scale_shape(num_local, shape[1], shape[2], block)
            for param, dtype, size in ((name, torch.float8_e4m3fn, shape),
                                       (name + "_scale_inv", torch.float32, scale)):  # fmt: skip
                tensor = torch.empty(size, dtype=dtype, device=device)
                self.register_parameter(param, nn.Parameter(tensor, requires_grad=False))
        self.fp8_block = tuple(block)

    def filled_by(self, param: str, tensor: torch.Tensor) -> tuple[str, ...]:
        """The parameters load(param, tensor, ...) fills: a float weight given to FP8
        experts fills its scales too (it is quantized)."""
        return (param, param + "_scale_inv") if self._quantizes(param, tensor) else (param,)

    def _quantizes(self, param: str, tensor: torch.Tensor) -> bool:
        plain = param in ("gate_up_proj", "down_proj")
        return self.fp8_block is not None and plain and tensor.dtype != torch.float8_e4m3fn

    def param_names(self) -> tuple[str, ...]:
        """The parameters a checkpoint fills."""
        if self.fp8_block is not None:
            return ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")
        if self.group_size is None:
            return ("gate_up_proj", "down_proj")
        return tuple(f"{n}_{p}" for n in ("gate_up_proj", "down_proj") for p in ("packed", "scale"))

    def weights(self) -> tuple[torch.Tensor | PackedExperts, torch.Tensor | PackedExperts]:
        """(gate_up, down) as fused_experts takes them: the stacked weights, or INT4."""
        if self.fp8_block is not None:
            return tuple(
                Fp8Experts(getattr(self, name), getattr(self, name + "_scale_inv"), self.fp8_block)
                for name in ("gate_up_proj", "down_proj")
            )
        if self.group_size is None:
            return self.gate_up_proj, self.down_proj
        return tuple(
            PackedExperts(
                getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale"),
                self.group_size, k,
            )
            for name, k in (("gate_up_proj", self.hidden), ("down_proj", self.inter))
        )  # fmt: skip

    def shard_names(self, param: str) -> list[str]:
        """The shards this rank's `param` is filled by (its block's experts)."""
        parts = ("gate", "up") if param.startswith("gate_up_proj") else ("down",)
        return [f"{e}.{p}" for e in self.local_experts for p in parts]

    def holds(self, shard: str) -> bool:
        """Whether this rank holds shard "{e}.{part}" (expert e is in its block)."""
        expert = shard.partition(".")[0]
        return expert.isdigit() and int(expert) in self.local_experts

    def load(self, param: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        if param not in self.param_names():
            expected = ", ".join(self.param_names())
            raise ValueError(f"unexpected expert parameter {param!r} ({expected})")
        if self._quantizes(param, tensor):  # a float weight into FP8 experts
            tensor = tensor.to(self.gate_up_proj.device)  # quantized where the experts live
            q, scale = fp8_experts.quantize_experts(tensor, self.fp8_block)
            self.load(param, q, shard)
            self.load(param + "_scale_inv", scale, shard)
            return
        target = getattr(self, param)
        first = self.local_experts.start
        if shard is None:
            if tensor.dim() == 0 or tensor.shape[0] != self.num_experts:
                raise ValueError(
                    f"shape {tuple(tensor.shape)} is not {self.num_experts} stacked experts"
                )
            tensor = tensor[first : first + len(self.local_experts)]
        else:
            expert, _, part = shard.partition(".")
            known = ("gate", "up") if param.startswith("gate_up_proj") else ("down",)
            if not expert.isdigit() or int(expert) >= self.num_experts or part not in known:
                raise ValueError(f"unexpected shard {shard!r} of {param}")
            if int(expert) not in self.local_experts:
                return  # another rank's expert
            target = target[int(expert) - first]
            scale_rows = param.endswith("_scale_inv")  # in blocks of rows
            split = self.inter // self.fp8_block[0] if scale_rows else self.inter
            if part == "gate":
                target = target[:split]
            elif part == "up":
                target = target[split:]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The routed experts' sum for x, plus residual where given (fused_experts; on
        grouped_mm, which bench_kernels.py --moe measured faster than the Triton GEMMs
        of `triton_moe` at every size its sweep tried; INT4 experts on CUDA through
        kernels/int4_moe.py)."""
        gate_up, down = self.weights()
        packed_on_gpu = self.group_size is not None and x.is_cuda
        if isinstance(gate_up, Fp8Experts) and fp8_experts.serves(x, gate_up):
            tuning = fp8_experts.moe_tuning(x, ids.shape[1], gate_up)
        else:
            tuning = int4_moe_tuning(x, ids.shape[1], gate_up) if packed_on_gpu else None
        if tuning is None and x.is_cuda and batch_invariant.active():
            # one fixed tiling whatever each expert's token count (grouped_mm's is not)
            tuning = TUNING
        return fused_experts(
            x,
            gate_up,
            down,
            weights,
            ids,
            first_expert=None if self.holds_all else self.local_experts.start,
            triton_moe=tuning,
            residual=residual,
        )
