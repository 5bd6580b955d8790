"""The build's first half: the config resolved for one model on one device into an
`EnginePlan` (pages, the host budget's split, attention backend, graphs, overlap), with
the warm-up forwards that measure it (`Warmup`). builder.py builds the components from
the plan."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from batchgen.config import EngineConfig
from batchgen.distributed.messages import Profile, Setup
from batchgen.engine.decode_graphs import graphs_wanted
from batchgen.engine.executor import Executor
from batchgen.engine.memory import (
    WIDEST_SAMPLING,
    copy_bytes_per_second,
    norm_bucket_sizes,
    plan_num_pages,
    recompute_seconds_per_token,
    split_host_budget,
    warmup_forward,
)
from batchgen.kv.host_pool import HostPool
from batchgen.kv.layout import KVLayout
from batchgen.kv.state_pool import StateLayout, StatePool
from batchgen.layers.expert_parallel import ExpertParallel
from batchgen.layers.tp_group import TPGroup
from batchgen.runner.graph_sampling import sampling_graph_reserve
from batchgen.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def state_bytes_per_seq(hf_config, conv_dtype: torch.dtype = torch.bfloat16) -> int:
    """Device bytes of compressed state a running request holds in a model with
    linear-attention layers (`layer_types`): a `StateLayout` slot of those layers, read
    from the config before any model exists (the window's q, k and v in `conv_dtype`,
    the GPU's bfloat16 by default); 0 for a model without them."""
    layers = list(getattr(hf_config, "layer_types", None) or ()).count("linear_attention")
    if not layers:
        return 0
    heads, dim = hf_config.linear_num_heads, hf_config.linear_head_dim
    return StateLayout(
        num_layers=layers,
        num_heads=heads,
        head_k_dim=dim,
        head_v_dim=dim,
        conv_dim=3 * heads * dim,
        conv_kernel=getattr(hf_config, "linear_conv_kernel_dim", 4),
        conv_dtype=conv_dtype,
    ).bytes_per_slot


def with_limits_for(config: EngineConfig, device: torch.device, hf_config) -> EngineConfig:
    """config resolved for `device` and this model (EngineConfig.resolve): its unset
    batch limits set for a hybrid model's compressed state a row and whether it routes
    to experts, async scheduling kept only where it can run."""
    return config.resolve(device, state_bytes_per_seq(hf_config), has_moe_layers(hf_config))


def expert_parallel(config: EngineConfig, group: TPGroup) -> ExpertParallel | None:
    """The MoE layers' expert parallel over `group` where the config enables it, else
    None: under attention data parallel (data_parallel_size > 1, `group` the data-parallel
    ranks) each rank brings its own tokens, at most max_num_seqs in a decode step run
    under the fixed-capacity exchange (its buffers the round's agreed bucket:
    runner/paired.py); under tensor parallel (`group`
    its ranks) every rank gets the same tokens and runs a slice of them."""
    if not config.enable_expert_parallel or group.size == 1:
        return None
    if config.data_parallel_size > 1:
        return ExpertParallel(group, local_tokens=True, max_tokens=config.max_num_seqs)
    return ExpertParallel(group)


def has_moe_layers(hf_config) -> bool:
    """Whether the model routes tokens to experts: DeepSeek-V3's `n_routed_experts` or
    Kimi Linear's `num_local_experts` (behind transformers' name `num_experts`)."""
    return any(getattr(hf_config, name, None) for name in ("n_routed_experts", "num_local_experts"))


def kv_layout(config: EngineConfig, model, hf_config, dtype: torch.dtype) -> KVLayout:
    """The page geometry of this rank's share of `model` (model.kv_state: its KV heads;
    under MLA the whole latent), the same on every rank but for the heads; its pages
    hold `dtype` (the compute dtype) or FP8 as config.kv_cache_dtype says."""
    num_kv_layers = getattr(model, "num_kv_layers", hf_config.num_hidden_layers)
    return KVLayout.of(model.kv_state, num_kv_layers, config.page_size, config.kv_dtype(dtype))


def attention_backend(config: EngineConfig, model, device: torch.device) -> str:
    """The configured backend, where the model's attention has it: a model that lists
    its own in `attention_backends` is held to them, and "auto" falls back to torch for
    it."""
    backend = config.resolved_attention_backend(device)
    supported = getattr(model, "attention_backends", None)
    if supported is None or backend in supported:
        return backend
    if config.attention_backend == "auto":
        return "torch"
    raise ValueError(
        f"{type(model).__name__} has no {backend!r} attention backend "
        f"(it runs on {', '.join(supported)})"
    )


def graph_sampling_reserve(
    config: EngineConfig, vocab: int, dtype: torch.dtype, graphs: bool, ranks: int
) -> int:
    """Device bytes the memory plan keeps out of the KV pool for the decode graphs that
    sample (runner/graph_sampling.py): where decode graphs are captured on one rank (a
    tensor-parallel group, or attention data parallel's ranks, sample after the replay:
    `ranks` counts both), their logits, penalty copy and kept counts at max_num_seqs
    rows, which no warm-up step measures."""
    if not graphs or ranks > 1:
        return 0
    return sampling_graph_reserve(config.max_num_seqs, vocab, dtype)


def check_pool_size(config: EngineConfig, num_pages: int, max_model_len: int) -> None:
    if not isinstance(num_pages, int) or num_pages * config.page_size < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_pages * config.page_size} tokens, fewer than "
            f"max_model_len={max_model_len}: lower max_model_len or give the cache "
            "more memory"
        )


def overlap_mode(config: EngineConfig) -> str:
    """How steps overlap: "async" (the next step scheduled and launched while this one
    runs; EngineConfig.resolve turned it off, with a warning, where it cannot run),
    "pipelined" (the next decode step queued before this one's tokens are read) or
    "plain"."""
    if config.async_scheduling:
        return "async"
    return "pipelined" if config.pipeline_decode else "plain"


@dataclass(frozen=True)
class EnginePlan:
    """What the config resolves to for one model on one device: plain data, the same for
    every rank (rank 0 sends it to the tensor-parallel workers, `build_runner` builds
    any rank's pool and runner from it)."""

    num_pages: int  # the device pool's, on every rank
    host_pages: int  # the host tier's page pool (0: no tier)
    host_state_slots: int  # the state tier's host slots (hybrid models; 0: none)
    eos_token_ids: list[int]
    attention_backend: str  # decode takes the same path on every rank (decode_graphs.py)
    graphs: bool  # decode CUDA graphs captured
    max_model_len: int
    prefix_caching: bool
    host_tier: bool  # host_kv_size_gib > 0
    overlap: str  # overlap_mode: "plain", "pipelined" or "async"
    # pipelined decode with the host tier on one rank: a step's stores ahead (swap-outs'
    # pages) are submitted once its forward is launched, off the step's critical path
    # (TieredKVManager.flush); tensor parallel keeps them in the step's copy log
    defer_stores_ahead: bool

    def setup(self) -> Setup:
        """What a tensor-parallel worker builds its pool and runner from (build_runner,
        as rank 0 does)."""
        return Setup(
            num_pages=self.num_pages,
            host_pages=self.host_pages,
            host_state_slots=self.host_state_slots,
            eos_token_ids=tuple(self.eos_token_ids),
            attention_backend=self.attention_backend,
            graphs=self.graphs,
        )


class Warmup:
    """The build's throw-away prefill steps (memory.warmup_forward), on every rank: the
    memory plan's profile, fla-core's norm buckets and the tier's cost rule."""

    def __init__(
        self,
        config: EngineConfig,
        model,
        hf_config,
        layout: KVLayout,
        state_pool: StatePool | None,
        device: torch.device,
        eos_token_ids: list[int],
        max_model_len: int,
        backend: str,
        peers=None,
    ) -> None:
        self.config, self.model, self.hf_config = config, model, hf_config
        self.layout, self.state_pool, self.device = layout, state_pool, device
        self.eos_token_ids, self.max_model_len, self.backend = eos_token_ids, max_model_len, backend
        self.peers = peers  # rank 0's executor: its other ranks run every step too
        self.profiled: set[int] = set()  # the steps' sizes run so far

    def forward(
        self, num_tokens: int, max_len: int | None = None, params: SamplingParams | None = None
    ) -> None:
        """A prefill step of num_tokens in prompts of at most max_len tokens (None: as
        long as max_model_len allows), each sampled with `params` (None: greedy), on
        every rank."""
        longest = self.max_model_len - 1 if max_len is None else max_len
        if self.peers is not None:  # the other ranks run it too: collectives pair up
            self.peers.send(Profile(num_tokens, longest, tuple(self.eos_token_ids)))
        states = None if self.state_pool is None else self.state_pool.layer_states()
        warmup_forward(
            self.model,
            self.layout,
            self.device,
            self.hf_config,
            self.eos_token_ids,
            num_tokens,
            self.backend,
            linear_states=states,
            state_slot=self.config.max_num_seqs,  # the spare slot (build_state_pool)
            max_len=longest,
            params=params,
        )
        self.profiled.add(num_tokens)

    def sampler(self) -> None:
        """The memory plan's sampler step: as many one-token prompts as a step may hold
        rows (max_num_seqs), each sampled with every filter, penalty and logprobs
        (WIDEST_SAMPLING); a vocabulary-wide tensor or several a row."""
        self.forward(self.config.max_step_rows, max_len=1, params=WIDEST_SAMPLING)

    def linear_norms(self) -> None:
        """On a GPU, a model with linear-attention layers runs a prefill step of each
        size norm_bucket_sizes names, so that fla-core autotunes its norms at build time
        rather than in the middle of a run (a first mixed step of a new size otherwise
        stalled W6 for 12-15 s on a fresh machine)."""
        if self.device.type != "cuda" or self.state_pool is None:
            return
        heads = self.state_pool.layout.num_heads
        for n in norm_bucket_sizes(self.config.max_num_batched_tokens, heads):
            if n not in self.profiled:  # the memory plan's own step counts
                self.forward(n)

    def tier_cost(self) -> dict:
        """The cost rule: keep a token's KV on host and load it back when moving its
        bytes twice at the measured copy rate (the write-back the step waits for, then
        the load) takes less time than recomputing it at the measured prefill rate
        (tier_policy="always" loads regardless)."""
        config = self.config
        per_token = self.layout.bytes_per_page / config.page_size
        num = min(config.max_num_batched_tokens, self.max_model_len - 1)
        if self.device.type != "cuda":
            num = min(num, 256)  # keeps a CPU start quick; tiny models are launch-bound
        recompute = recompute_seconds_per_token(self.forward, num, self.device)
        load = per_token / copy_bytes_per_second(self.device)
        loads_pay = config.tier_policy == "always" or 2 * load < recompute
        logger.info(
            "tier cost rule: load %.3g us/token, recompute %.3g us/token -> %s",
            load * 1e6,
            recompute * 1e6,
            "load" if loads_pay else "recompute",
        )
        return dict(
            loads_pay=loads_pay,
            load_us_per_token=load * 1e6,
            recompute_us_per_token=recompute * 1e6,
        )


def resolve_plan(
    config: EngineConfig,
    model,
    warmup: Warmup,
    dtype: torch.dtype,
    executor: Executor,
) -> EnginePlan:
    """The plan for this model on warmup's device over `executor`'s ranks: the pages the
    memory plan leaves (the fewest any rank has room for, less the sampling decode
    graphs' reserve), the host budget's split into
    pages and state slots, whether decode captures graphs, how steps overlap."""
    layout, state_pool, device = warmup.layout, warmup.state_pool, warmup.device
    graphs = graphs_wanted(config, model, dtype, device, warmup.backend)
    vocab = warmup.hf_config.vocab_size
    ranks = executor.size * config.data_parallel_size
    reserve = graph_sampling_reserve(config, vocab, dtype, graphs, ranks)
    num_pages = plan_num_pages(
        config, layout, device, warmup.forward, warmup.sampler, executor, reserve
    )
    warmup.linear_norms()
    check_pool_size(config, num_pages, warmup.max_model_len)
    # the host tier's budget: GiB of KV pages, and host slots of compressed state
    page_gib, host_slots = split_host_budget(
        config, None if state_pool is None else state_pool.layout
    )
    # hybrid models: a prefix hit needs the recurrent state at the hit's last token,
    # which only the host tier's state checkpoints keep; without them nothing is cached
    host_tier = config.host_kv_size_gib > 0
    checkpoints = host_tier and config.state_checkpoint_interval > 0
    overlap = overlap_mode(config)
    return EnginePlan(
        num_pages=num_pages,
        host_pages=HostPool.pages_in(layout, page_gib),
        host_state_slots=host_slots,
        eos_token_ids=warmup.eos_token_ids,
        attention_backend=warmup.backend,
        graphs=graphs,
        max_model_len=warmup.max_model_len,
        prefix_caching=config.enable_prefix_caching and (state_pool is None or checkpoints),
        host_tier=host_tier,
        overlap=overlap,
        defer_stores_ahead=host_tier and overlap == "pipelined" and executor.size == 1,
    )
