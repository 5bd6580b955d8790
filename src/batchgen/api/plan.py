"""What fits on a GPU, from a model's config alone (`batchgen plan`): the weights' bytes
per GPU in each precision, the KV pages (and a hybrid model's state slots) the engine's
memory plan leaves beside them, and the largest batch those hold at a context length.

    budget  = card x gpu_memory_utilization - weights - state slots - reserve
    pages   = budget // KVLayout.bytes_per_page         (engine/memory.py's rule)
    batch   = pages // ceil(context / page_size)        per engine, x dp over all GPUs

The engine measures its reserve (the warm-up steps' peak above the weights) and adds
its sampling decode graphs' (graph_sampling.sampling_graph_reserve); the plan
estimates it (`activation_reserve`). Weight bytes read the tensors' sizes as the
engine's layers shape them (plan_model.py), the quantized ones as their checkpoints
store them:

    bf16       2 bytes an element
    fp8        1 byte an element + a float32 scale a 128 x 128 block (DeepSeek-V3's)
    int4-gG    half a byte an element (int32 words of 8) + a bfloat16 scale a group of
               G along the input (compressed-tensors pack-quantized, Kimi-K2-Thinking's);
               a MoE model's routed experts only, as that checkpoint ships
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from batchgen.api.plan_model import KIMI_LINEAR, Parallel, Weight, architecture, model_weights
from batchgen.config import (
    DEFAULT_LIMITS,
    LARGE_GPU_GIB,
    LARGE_GPU_LIMITS,
    MOE_LARGE_TOKENS,
    STATE_POOL_SHARE,
    EngineConfig,
)
from batchgen.engine.builder_plan import has_moe_layers, state_bytes_per_seq
from batchgen.kv.layout import KVLayout
from batchgen.kv.state_pool import StateLayout
from batchgen.kv_state import KVState
from batchgen.runner.graph_sampling import sampling_graph_reserve

MIB = 2**20
# device memory as CUDA reports it (torch.cuda.mem_get_info's total), by card
CARDS = {
    "h200": 143771 * MIB,
    "h100": 81559 * MIB,
    "a100": 81920 * MIB,
    "a100-40": 40960 * MIB,
    "l40s": 46068 * MIB,
    "b200": 183359 * MIB,
}
# the reserve's estimate (activation_reserve)
PREFILL_HIDDEN_ROWS = 8  # hidden-wide bfloat16 rows a token of a prefill step holds
SAMPLER_ROWS = 4  # vocabulary-wide float32 rows a sampled row holds (logits, probs, ...)
OUTSIDE_TORCH = 2**30  # the CUDA context and NCCL's buffers


@dataclass(frozen=True)
class Precision:
    """How weights are stored. `bits` 16 (bfloat16), 8 (float8 with a float32 scale a
    `block` x `block` tile) or 4 (int4 with a bfloat16 scale a group of `block`).
    `experts_only`: on a MoE model, only the routed experts are quantized. `ignore`: a
    quantization config's names or "re:" patterns of modules kept in bfloat16."""

    name: str
    bits: int = 16
    block: int = 0
    experts_only: bool = False
    ignore: tuple[str, ...] = ()
    shipped: bool = False

    def quantizes(self, w: Weight, moe: bool) -> bool:
        """Whether this precision would hold `w` quantized, on its own (a stacked
        tensor's neighbours decide too: `quantized`)."""
        if self.bits == 16 or not w.linear or (self.experts_only and moe and w.part != "experts"):
            return False
        return not any(_matches(pattern, w.module) for pattern in self.ignore)

    def quantized(self, weights: list[Weight], moe: bool, tp: int = 1) -> list[bool]:
        """For each weight, whether it is held quantized: a stack is quantized whole,
        where each of its tensors is and, under tensor parallel (`tp` > 1), each is whole
        scale blocks (the engine's ColumnParallelLinear.check_units; FP8 scales cover 128
        rows, INT4's one). One process holds a stack whose tensors start inside blocks
        too, each in blocks of its own (Linear.unit_rows)."""
        rows_per = self.block if self.bits == 8 else 1
        stacks: dict[str, bool] = {}
        for w in weights:
            if w.stack:
                ok = self.quantizes(w, moe) and (tp == 1 or w.rows % rows_per == 0)
                stacks[w.stack] = stacks.get(w.stack, True) and ok
        return [stacks[w.stack] if w.stack else self.quantizes(w, moe) for w in weights]

    def total(self, weights: list[Weight], moe: bool, tp: int = 1) -> int:
        """Bytes of all `weights` in this precision (`tp`: see quantized), with the int32
        a row a quantized stack keeps where a tensor starts inside a scale block (the
        engine's Linear.unit_index)."""
        held = self.quantized(weights, moe, tp)
        rows_per = self.block if self.bits == 8 else 1
        offsets: dict[str, int] = {}
        off_grid: dict[str, int] = {}  # stack -> its rows x count, where off the grid
        for w, q in zip(weights, held):
            if w.stack and q:
                if offsets.get(w.stack, 0) % rows_per:
                    off_grid[w.stack] = 0
                offsets[w.stack] = offsets.get(w.stack, 0) + w.rows
        index = sum(4 * w.rows * w.count for w in weights if w.stack in off_grid)
        return index + sum(self.nbytes(w, q) for w, q in zip(weights, held))

    def nbytes(self, w: Weight, quantized: bool) -> int:
        """Bytes of the `w.count` tensors in this precision, held quantized or not."""
        if w.fp32:
            return 4 * w.numel
        if not quantized:
            return 2 * w.numel
        if self.bits == 8:
            scales = math.ceil(w.rows / self.block) * math.ceil(w.cols / self.block)
            return w.count * (w.rows * w.cols + 4 * scales)
        words = w.rows * math.ceil(w.cols / 8)
        groups = w.rows * math.ceil(w.cols / self.block)
        return w.count * (4 * words + 2 * groups)


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


PRECISIONS = (
    Precision("bf16"),
    Precision("fp8", 8, 128),
    Precision("int4-g32", 4, 32, experts_only=True),
    Precision("int4-g128", 4, 128, experts_only=True),
)


def shipped_precision(config) -> Precision | None:
    """The precision a checkpoint ships in, from its quantization_config: block-scaled
    FP8 (DeepSeek-V3's) or compressed-tensors pack-quantized INT4; None for bfloat16 or
    a format the plan does not know."""
    q = getattr(config, "quantization_config", None)
    if not isinstance(q, dict):
        q = q.to_dict() if q is not None else None
    if not q:
        return None
    if q.get("quant_method") == "fp8" and q.get("weight_block_size"):
        block = q["weight_block_size"][0]
        return Precision("fp8", 8, block, ignore=tuple(q.get("modules_to_not_convert") or ()), shipped=True)  # fmt: skip
    if q.get("quant_method") == "compressed-tensors":
        for group in (q.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            if w.get("num_bits") == 4 and w.get("type") == "int" and w.get("group_size"):
                g = w["group_size"]
                return Precision(f"int4-g{g}", 4, g, ignore=tuple(q.get("ignore") or ()), shipped=True)  # fmt: skip
    return None


def precisions(config) -> list[Precision]:
    """PRECISIONS, the one the checkpoint ships in put in its place (or added)."""
    shipped = shipped_precision(config)
    out = [shipped if shipped and p.name == shipped.name else p for p in PRECISIONS]
    if shipped and shipped not in out:
        out.append(shipped)
    return out


@dataclass(frozen=True)
class Limits:
    """The engine's memory settings the plan uses (EngineConfig's defaults unless set)."""

    gpu_memory_utilization: float = EngineConfig.gpu_memory_utilization
    page_size: int = EngineConfig.page_size
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None

    def resolved(self, card_bytes: int, moe: bool, state_bytes: int) -> Limits:
        """max_num_seqs and max_num_batched_tokens left None set as
        EngineConfig.with_batch_limits sets them on a GPU of `card_bytes`."""
        seqs, tokens = DEFAULT_LIMITS
        if card_bytes >= LARGE_GPU_GIB * 2**30:
            seqs, tokens = LARGE_GPU_LIMITS
            tokens = MOE_LARGE_TOKENS if moe else tokens
            while seqs > DEFAULT_LIMITS[0] and seqs * state_bytes > card_bytes * STATE_POOL_SHARE:
                seqs //= 2
        return Limits(
            self.gpu_memory_utilization,
            self.page_size,
            self.max_num_seqs or seqs,
            self.max_num_batched_tokens or tokens,
        )


@dataclass(frozen=True)
class Fit:
    """One precision's row: bytes a GPU, what is left for KV, the batch it holds."""

    precision: Precision
    weight_bytes: int
    budget_bytes: int  # what is left for KV pages a GPU (negative: the weights do not fit)
    kv_pages: dict[str, int] = field(default_factory=dict)  # by KV dtype name
    batch: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    config: object
    parallel: Parallel
    card: str
    card_bytes: int
    context: int
    limits: Limits
    reserve_bytes: int
    kv_bytes_per_token: dict[str, int]
    state_slots: int  # a hybrid model's slots a GPU (0: none)
    state_bytes: int  # their bytes a GPU
    parameters: int  # the decoder's parameters, every GPU's counted once
    fits: list[Fit]


KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def kv_layout(config, parallel: Parallel, page_size: int, dtype: torch.dtype) -> KVLayout:
    """One GPU's page geometry, as the engine's model declares it: K and V of its KV
    heads (Llama family), or the whole MLA latent on every GPU."""
    if architecture(config) in ("DeepseekV3ForCausalLM", KIMI_LINEAR):
        state = KVState.latent(config.kv_lora_rank + config.qk_rope_head_dim)
    else:
        h = config.hidden_size
        d = getattr(config, "head_dim", None) or h // config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        state = KVState.mha(max(kv // parallel.tp, 1), d)
    layers = list(getattr(config, "layer_types", None) or ()).count("full_attention")
    if architecture(config) != KIMI_LINEAR:
        layers = config.num_hidden_layers
    return KVLayout.of(state, layers, page_size, dtype)


def state_layout(config, parallel: Parallel) -> StateLayout | None:
    """One GPU's compressed-state slot of a model with KDA layers (its heads), None for
    a model without."""
    if architecture(config) != KIMI_LINEAR:
        return None
    heads, d = config.linear_num_heads // parallel.tp, config.linear_head_dim
    return StateLayout(
        num_layers=list(config.layer_types).count("linear_attention"),
        num_heads=heads,
        head_k_dim=d,
        head_v_dim=d,
        conv_dim=3 * heads * d,
        conv_kernel=config.linear_conv_kernel_dim,
        conv_dtype=torch.bfloat16,
    )


def activation_reserve(config, parallel: Parallel, limits: Limits) -> int:
    """An estimate of the warm-up steps' peak above the weights (which the engine
    measures): the larger of a prefill step of max_num_batched_tokens (each token
    PREFILL_HIDDEN_ROWS hidden-wide rows and the widest MLP's: a dense layer's
    3 x intermediate / tp, a MoE layer's top-k experts' 3 x moe_intermediate) and the
    sampler's widest step (max_num_seqs rows of SAMPLER_ROWS float32 vocabulary rows),
    in bfloat16, plus OUTSIDE_TORCH, and on one tensor-parallel rank what the engine
    keeps aside for its decode graphs that sample (`sampling_graph_reserve`)."""
    mlp = 3 * config.intermediate_size // parallel.tp
    if has_moe_layers(config):
        top_k = getattr(config, "num_experts_per_tok", None) or 1
        mlp = max(mlp, 3 * top_k * config.moe_intermediate_size)
    prefill = limits.max_num_batched_tokens * 2 * (PREFILL_HIDDEN_ROWS * config.hidden_size + mlp)
    sampler = limits.max_num_seqs * SAMPLER_ROWS * 4 * config.vocab_size
    graphs = 0
    if parallel.tp == 1:  # a tensor-parallel group samples after the replay
        graphs = sampling_graph_reserve(limits.max_num_seqs, config.vocab_size, torch.bfloat16)
    return max(prefill, sampler) + OUTSIDE_TORCH + graphs


def parameters(config) -> int:
    """The decoder's parameters (what the engine loads; MTP layers left out), counted
    on one GPU holding all of it, the router's working copy left out."""
    return sum(
        w.numel for w in model_weights(config, Parallel()) if not w.module.endswith("_narrow")
    )


def plan(
    config,
    parallel: Parallel,
    card: str = "h200",
    context: int = 8192,
    limits: Limits = Limits(),
    card_bytes: int | None = None,
    reserve_bytes: int | None = None,
) -> Plan:
    """Every precision's fit of `config` under `parallel` on GPUs of `card` (CARDS, or
    `card_bytes` for another). ValueError where the layout does not split the model."""
    total = card_bytes or CARDS[card]
    moe = has_moe_layers(config)
    limits = limits.resolved(total, moe, state_bytes_per_seq(config))
    weights = model_weights(config, parallel)
    slot = state_layout(config, parallel)
    slots = limits.max_num_seqs if slot else 0
    # the engine's state pool: a slot a row and a spare (memory.build_state_pool)
    state = (slots + 1) * slot.bytes_per_slot if slot else 0
    reserve = (
        activation_reserve(config, parallel, limits) if reserve_bytes is None else reserve_bytes
    )
    layouts = {k: kv_layout(config, parallel, limits.page_size, d) for k, d in KV_DTYPES.items()}
    per_seq = math.ceil(context / limits.page_size)
    fits = []
    for precision in precisions(config):
        nbytes = precision.total(weights, moe, parallel.tp)
        budget = total * limits.gpu_memory_utilization - nbytes - state - reserve
        pages = {k: max(int(budget // lay.bytes_per_page), 0) for k, lay in layouts.items()}
        rows = {
            k: p // per_seq if not slots else min(p // per_seq, slots) for k, p in pages.items()
        }
        batch = {k: r * parallel.dp for k, r in rows.items()}
        fits.append(Fit(precision, nbytes, int(budget), pages, batch))
    per_token = {k: lay.bytes_per_page // lay.page_size for k, lay in layouts.items()}
    return Plan(
        config, parallel, card, total, context, limits, reserve, per_token, slots, state,
        parameters(config), fits,
    )  # fmt: skip
