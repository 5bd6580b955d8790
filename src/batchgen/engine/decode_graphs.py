"""The decode fast path as every rank builds it: the decode kernel's split plan and the
decode CUDA graphs. Rank 0 (EngineCore) and each tensor-parallel worker build theirs
here, from the same config and model class, so their decode steps take the same path:
a graph replay on one rank pairs its captured collectives with the other ranks' replays
of the same bucket."""

from __future__ import annotations

import logging

import torch

from batchgen.config import EngineConfig
from batchgen.kv.copy_engine import CopyEngine
from batchgen.kv.layout import KVLayout
from batchgen.kv.state_pool import StatePool
from batchgen.runner.cuda_graphs import DecodeGraphs, DecodeSplitPlan
from batchgen.runner.inputs import table_pages

logger = logging.getLogger(__name__)


def decode_split_heads(model, layout: KVLayout, dtype: torch.dtype, device) -> int:
    """What the split plan counts as KV heads: the model's decode programs per (request,
    split) where it says (`decode_split_heads`: MLA's head blocks), else the layout's KV
    heads (the GQA decode kernel's programs; a rank's own under tensor parallel)."""
    heads = getattr(model, "decode_split_heads", None)
    return layout.num_kv_heads if heads is None else heads(dtype, device)


def decode_split_plan(
    config: EngineConfig,
    model,
    layout: KVLayout,
    dtype: torch.dtype,
    device: torch.device,
    backend: str,
    max_len: int,
) -> DecodeSplitPlan | None:
    """The Triton decode kernel's split plan on a GPU (None elsewhere): the same split
    count for an eager step and a replay of the same batch."""
    if backend != "triton" or device.type != "cuda":
        return None
    return DecodeSplitPlan(
        config.max_num_seqs, decode_split_heads(model, layout, dtype, device), max_len, device
    )


def graphs_wanted(
    config: EngineConfig, model, dtype: torch.dtype, device: torch.device, backend: str
) -> bool:
    """Whether decode steps replay CUDA graphs: on a GPU with the (graph-safe) Triton
    backend, unless enforce_eager, when the model's decode forward has no host sync for
    this dtype and device (its optional `graph_safe(dtype, device)`; DeepSeek-V3's MoE
    only on the grouped-GEMM path; otherwise decode runs eagerly, logged)."""
    if config.enforce_eager or device.type != "cuda" or backend != "triton":
        return False
    graph_safe = getattr(model, "graph_safe", None)
    if graph_safe is not None and not graph_safe(dtype, device):
        logger.info(
            "decode runs eagerly: %s cannot be captured in %s on this device",
            type(model).__name__,
            dtype,
        )
        return False
    return True


def build_decode_graphs(
    config: EngineConfig,
    model,
    kv_caches: list,
    backend: str,
    plan: DecodeSplitPlan,
    hidden_size: int,
    device: torch.device,
    dtype: torch.dtype,
    max_len: int,
    copies: CopyEngine | None = None,
    state_pool: StatePool | None = None,
) -> DecodeGraphs:
    """Decode CUDA graphs over the pool's `kv_caches` (captured at the first replay).
    `copies`: the host tier's CopyEngine, if any, paused around every capture (rule 6: no
    copy task issues CUDA work while a graph is captured). A model with linear-attention
    layers binds its state pool (padding rows on the spare slot)."""
    return DecodeGraphs(
        model,
        kv_caches,
        backend,
        config.max_num_seqs,
        table_pages(max_len, config.page_size),  # the runner's rows: one stride
        hidden_size,
        device,
        dtype,
        plan,
        capture_guard=copies.paused if copies is not None else None,
        linear_states=None if state_pool is None else state_pool.layer_states(),
        spare_slot=config.max_num_seqs,  # the state pool's spare (build_state_pool)
    )
