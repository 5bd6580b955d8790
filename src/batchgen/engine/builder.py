"""The engine's construction, in one place: the config resolved into a plan
(builder_plan.py), then each component built once, with what it depends on as
constructor arguments, in dependency order:

    plan       limits, KV layout, state pool, the warm-up profile -> EnginePlan
    device     page pool; decode split plan, CUDA graphs, runner (`build_runner`, which
               any rank runs with the plan's `Setup`, the message workers get)
    host tier  copy engine and metrics -> state tier -> page tier over the device
               pool's allocator (built first: the KV manager holds it too)
    policy     KV manager (allocator, tier) -> checkpoints, exact swap -> scheduler

Nothing is wired after construction (scripts/hygiene/wiring.py checks engine/ and kv/).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from batchgen.config import DETERMINISTIC_CHUNK, EngineConfig
from batchgen.distributed.messages import Setup
from batchgen.engine.builder_plan import (
    EnginePlan,
    Warmup,
    attention_backend,
    kv_layout,
    resolve_plan,
    with_limits_for,
)
from batchgen.engine.decode_graphs import build_decode_graphs, decode_split_plan
from batchgen.engine.detokenizer import Detokenizer
from batchgen.engine.executor import Executor
from batchgen.engine.kernel_prep import kernels_prepared
from batchgen.engine.limits import eos_token_ids, generation_eos, max_model_len
from batchgen.engine.memory import build_state_pool, remake_pool, state_layout
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.step_loop import Overlap, build_overlap
from batchgen.engine.structured import StructuredOutputs
from batchgen.kv.copy_engine import CopyEngine
from batchgen.kv.exact_swap import ExactSwap
from batchgen.kv.host_pool import HostPool
from batchgen.kv.kv_manager import KVCacheManager
from batchgen.kv.layout import KVLayout
from batchgen.kv.page_allocator import PageAllocator
from batchgen.kv.page_pool import PagePool
from batchgen.kv.state_checkpoints import StateCheckpoints
from batchgen.kv.state_pool import HostStatePool, StatePool, StateSlots
from batchgen.kv.state_tier import StateTier
from batchgen.kv.tier_metrics import TierMetrics
from batchgen.kv.tiered import TieredKVManager
from batchgen.runner.inputs import table_pages
from batchgen.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """Everything EngineCore runs, built (build_engine) and handed over whole."""

    config: EngineConfig  # with its batch limits set for this device and model
    model: torch.nn.Module
    hf_config: object
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    plan: EnginePlan
    warmup: Warmup  # its throw-away steps (tests run them again)
    layout: KVLayout
    pool: PagePool
    state_pool: StatePool | None
    state_slots: StateSlots | None
    kv: KVCacheManager
    tier: TieredKVManager | None
    tier_cost: dict | None  # the tier's cost rule, as measured (Warmup.tier_cost)
    checkpoints: StateCheckpoints | None
    exact_swap: ExactSwap | None
    scheduler: Scheduler
    runner: ModelRunner
    overlap: Overlap  # what runs ahead of the device: step_loop's policy for plan.overlap
    structured: StructuredOutputs  # xgrammar loaded at the first constrained request
    detokenizer: Detokenizer
    executor: Executor  # the ranks: executor.OneRank, or tp_peers.TPWorkers


def build_engine(
    config: EngineConfig,
    model,
    hf_config,
    tokenizer,
    device: torch.device,
    dtype: torch.dtype,
    executor: Executor,
) -> EngineParts:
    """Rank 0's components for `model` on `device` over the ranks of `executor`
    (executor.OneRank; tensor parallel, tp_peers.TPWorkers: rank 0's share, each other
    rank building its pool and runner from the plan sent to it here), with the Triton
    kernels made ready first (kernel_prep)."""
    with kernels_prepared(device, state_layout(model, dtype) is not None):
        return _build_engine(config, model, hf_config, tokenizer, device, dtype, executor)


def _build_engine(config, model, hf_config, tokenizer, device, dtype, executor) -> EngineParts:
    config = with_limits_for(config, device, hf_config)
    max_len = max_model_len(config, hf_config)
    eos = eos_token_ids(hf_config, tokenizer, generation_eos(config.model))
    layout = kv_layout(config, model, hf_config, dtype)
    # allocated before the warm-up profile: its bytes count in the peak, so they come
    # out of what the KV pool may use
    state_pool = build_state_pool(model, config, dtype, device)
    backend = attention_backend(config, model, device)
    warmup = Warmup(
        config, model, hf_config, layout, state_pool, device, eos, max_len, backend, executor
    )
    plan = resolve_plan(config, model, warmup, dtype, executor)
    executor.send(plan.setup())  # each rank builds pools of the same pages and slots
    pool = PagePool(layout, plan.num_pages, device)
    allocator = PageAllocator(plan.num_pages, plan.prefix_caching)  # the KV manager's, the tier's
    state_slots = None if state_pool is None else StateSlots(config.max_num_seqs)
    tier = checkpoints = tier_cost = None
    if plan.host_tier:
        pin = device.type == "cuda"
        host = HostPool(layout, plan.host_pages, pin=pin)
        tier_cost = warmup.tier_cost()
        states = None
        if plan.host_state_slots:
            states = HostStatePool(state_pool.layout, plan.host_state_slots, pin=pin)
        tier = build_tier(
            config,
            pool,
            host,
            allocator,
            state_pool,
            states,
            state_slots,
            tier_cost,
            mirrored=executor.size > 1,
        )
        checkpoints = build_checkpoints(config, tier.states)
    kv = KVCacheManager(allocator, config.page_size, tier, config.decode_append)
    exact_swap = None  # hybrid models' swap, over the state tier
    if tier is not None and tier.states is not None:
        exact_swap = ExactSwap(kv, tier.states, checkpoints, always=config.deterministic)
    scheduler = Scheduler(
        kv,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        max_len,
        eos,
        admission=config.admission,
        state_slots=state_slots,
        exact_swap=exact_swap,
        checkpoints=checkpoints,
        defer_stores_ahead=plan.defer_stores_ahead,
        chunk_align=DETERMINISTIC_CHUNK if config.deterministic and state_slots else 1,
    )
    structured = StructuredOutputs(tokenizer, hf_config.vocab_size, eos)
    runner = build_runner(
        plan.setup(),
        config,
        model,
        hf_config,
        pool,
        state_pool,
        device,
        dtype,
        plan.max_model_len,
        copies=None if tier is None else tier.copies,
        runner_cls=executor.runner_cls,
        debug=config.batchgen_debug,
        grammar=structured,
        **executor.runner_args(tier),
    )
    logger.info("engine config: %s", config.describe())
    logger.info(
        "KV cache: %d pages of %d tokens (%.2f GiB) on %s",
        plan.num_pages,
        config.page_size,
        pool.nbytes / 2**30,
        device,
    )
    return EngineParts(
        config=config,
        model=model,
        hf_config=hf_config,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        plan=plan,
        warmup=warmup,
        layout=layout,
        pool=pool,
        state_pool=state_pool,
        state_slots=state_slots,
        kv=kv,
        tier=tier,
        tier_cost=tier_cost,
        checkpoints=checkpoints,
        exact_swap=exact_swap,
        scheduler=scheduler,
        runner=runner,
        # admitting steps launched: one rank, no host tier (whose copies, finishing
        # between steps, free pages that schedule() would admit into at once)
        overlap=build_overlap(
            plan.overlap, runner, scheduler, kv, executor.size == 1 and tier is None
        ),
        structured=structured,
        detokenizer=Detokenizer(tokenizer),
        executor=executor,
    )


def build_runner(
    setup: Setup,
    config: EngineConfig,
    model,
    hf_config,
    pool: PagePool,
    state_pool: StatePool | None,
    device: torch.device,
    dtype: torch.dtype,
    max_len: int,
    copies: CopyEngine | None = None,
    runner_cls: type[ModelRunner] = ModelRunner,
    **runner_args,
) -> ModelRunner:
    """Any rank's runner over its `pool` (its share of the model), decoding as `setup`
    (EnginePlan.setup(), the message a tensor-parallel worker gets) says: the same
    attention backend on every rank and CUDA graphs where rank 0 captures them (paused
    against `copies`, the rank's host tier copy engine, while captured); its logits GEMM
    warmed for every row count a step may sample. `runner_args`: the rest of
    runner_cls's keyword arguments (rank 0: debug, the grammar, tensor parallel's
    workers)."""
    backend = setup.attention_backend
    split = decode_split_plan(config, model, pool.layout, dtype, device, backend, max_len)
    graphs = None
    if setup.graphs:
        graphs = build_decode_graphs(
            config,
            model,
            pool.layer_caches(),
            backend,
            split,
            hf_config.hidden_size,
            device,
            dtype,
            max_len,
            copies=copies,
            state_pool=state_pool,
        )
    runner = runner_cls(
        model,
        pool.layer_caches(),
        config.page_size,
        device,
        hf_config.vocab_size,
        list(setup.eos_token_ids),
        attention_backend=backend,
        graphs=graphs,
        split_plan=split,
        max_num_seqs=config.max_num_seqs,
        max_pages=table_pages(max_len, config.page_size),
        seed=config.seed,
        deterministic=config.deterministic,
        linear_states=None if state_pool is None else state_pool.layer_states(),
        **runner_args,
    )
    runner.warm_logits(config.max_step_rows, hf_config.hidden_size, dtype)
    return runner


def build_tier(
    config: EngineConfig,
    pool: PagePool,
    host: HostPool,
    allocator: PageAllocator,
    state_pool: StatePool | None,
    host_states: HostStatePool | None,
    state_slots: StateSlots | None,
    tier_cost: dict,
    mirrored: bool = False,
) -> TieredKVManager:
    """The host tier over the device `pool` and `host` pages, holding the pool's
    `allocator` beside the KV manager; with `host_states` (hybrid models) the state tier
    over `state_pool`'s slots on the same copy engine and metrics. `mirrored` (tensor
    parallel): both log each copy they submit to one list, for the workers' mirrors."""
    copies = CopyEngine(pool.kv.device, issue=config.tier_copy_issue, background=True)
    metrics = TierMetrics()
    log = [] if mirrored else None
    states = None
    if host_states is not None:  # hybrid models: requests swap with their compressed state
        states = StateTier(
            state_pool,
            host_states,
            state_slots,
            copies,
            metrics,
            debug=config.batchgen_debug,
            load_scatter=config.tier_load_scatter,
            mirror=None if log is None else log.append,
        )
        logger.info(
            "host state tier: %d slots (%.2f GiB)",
            host_states.num_slots,
            host_states.nbytes / 2**30,
        )
    elif state_pool is not None:
        logger.info("host state tier: no slot fits; preempted requests are recomputed")
    tier = TieredKVManager(
        pool,
        host,
        allocator,
        copies,
        debug=config.batchgen_debug,
        loads_pay=tier_cost["loads_pay"],
        load_scatter=config.tier_load_scatter,
        metrics=metrics,
        states=states,
        mirrored=log,
    )
    logger.info(
        "host KV tier: %d pages (%.2f GiB); %s",
        host.num_pages,
        host.nbytes / 2**30,
        "loads KV it holds" if tier.loads_pay else "idle: recomputing is cheaper",
    )
    return tier


def build_checkpoints(config: EngineConfig, states: StateTier | None) -> StateCheckpoints | None:
    """Hybrid models' prefix hits: state checkpoints in what the state tier's host slots
    leave after a seat per running request (None without them)."""
    if states is None or not config.state_checkpoint_interval:
        return None
    slots = states.host_pool.num_slots
    return StateCheckpoints(
        states,
        config.state_checkpoint_interval,
        config.page_size,
        max(slots - config.max_num_seqs, slots // 2, 1),
        shared_only=config.state_checkpoint_policy == "shared",
    )


def replace_pool(
    layout: KVLayout,
    num_pages: int,
    kv: KVCacheManager,
    tier: TieredKVManager | None,
    runner: ModelRunner,
    executor: Executor,
) -> tuple[PagePool, str | None, Exception | None]:
    """reconfigure()'s pool swap, once the caller has let go of the old pool and every
    tier copy is done: each worker first (with the copies rank 0 logged), then the
    runner's and the tier's references dropped so the old pool's memory can be freed,
    and a pool of num_pages handed to the KV manager, the tier and the runner. Where a
    rank cannot allocate it, every rank gets a pool of the old size back: the pool, what
    failed and the allocation's error."""
    old_pages = kv.allocator.num_pages
    errors = executor.reconfigure(num_pages, tier)  # the other ranks first, after the copies
    runner.set_kv_caches([])
    if tier is not None:
        tier.attach_device(None, None)
    # a worker that could not allocate: every rank stays at the old size
    wanted = old_pages if errors else num_pages
    pool, error = remake_pool(layout, wanted, old_pages, runner.device)
    kv.resize(pool.num_pages)
    if tier is not None:
        tier.attach_device(pool, kv.allocator)
    runner.set_kv_caches(pool.layer_caches())
    failure = "; ".join(errors) or (None if error is None else str(error))
    if failure:  # every rank back to the old page count
        executor.reconfigure(old_pages, tier)
    return pool, failure, error
