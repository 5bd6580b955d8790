"""EngineCore: the step loop. schedule() -> execute() -> update()."""

from __future__ import annotations

import itertools
import logging
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from batchgen.config import EngineConfig
from batchgen.distributed.messages import Profile, Setup
from batchgen.engine.decode_graphs import build_decode_graphs, decode_split_plan, graphs_wanted
from batchgen.engine.detokenizer import Detokenizer
from batchgen.engine.limits import eos_token_ids, generation_eos, max_model_len
from batchgen.engine.memory import (
    WIDEST_SAMPLING,
    build_state_pool,
    check_host_budget,
    copy_bytes_per_second,
    norm_bucket_sizes,
    plan_num_pages,
    recompute_seconds_per_token,
    remake_pool,
    split_host_budget,
    warmup_forward,
)
from batchgen.engine.pipeline import next_decode
from batchgen.engine.request import Request
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.tensor_parallel import TPModelRunner
from batchgen.engine.tp_peers import TPWorkers, check_supported
from batchgen.kv.copy_engine import CopyEngine
from batchgen.kv.exact_swap import ExactSwap
from batchgen.kv.host_pool import HostPool
from batchgen.kv.kv_manager import KVCacheManager
from batchgen.kv.layout import KVLayout
from batchgen.kv.page_allocator import PageAllocator
from batchgen.kv.page_pool import PagePool
from batchgen.kv.state_checkpoints import StateCheckpoints
from batchgen.kv.state_pool import HostStatePool, StateLayout, StateSlots
from batchgen.kv.state_tier import StateTier
from batchgen.kv.tier_metrics import TierMetrics
from batchgen.kv.tiered import TieredKVManager
from batchgen.models.loader import ModelSource, build_model, gguf_read_once
from batchgen.models.registry import check_tensor_parallel
from batchgen.runner.batch import SchedulerOutput, StepCopies
from batchgen.runner.model_runner import ModelRunner
from batchgen.runner.sampler import request_seed
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


def has_moe_layers(hf_config) -> bool:
    """Whether the model routes tokens to experts: DeepSeek-V3's `n_routed_experts` or
    Kimi Linear's `num_local_experts` (behind transformers' name `num_experts`)."""
    return any(getattr(hf_config, name, None) for name in ("n_routed_experts", "num_local_experts"))


class RequestsFailed(RuntimeError):
    """A step failed for these requests alone: the engine has dropped them (as abort()
    does) and every other request is intact, its tokens of the step applied; the
    requests the step finished come out of the next step() call."""

    def __init__(self, errors: dict[str, BaseException]) -> None:
        self.errors = errors  # request id -> why it failed
        first = next(iter(errors.values()))
        super().__init__(
            f"request(s) {', '.join(errors)} failed in a step: {type(first).__name__}: {first}"
        )

    @property
    def request_ids(self) -> list[str]:
        return list(self.errors)


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    steps: int = 0


class EngineCore:
    """Owns the model, the page pool, the scheduler and the runner for one process."""

    def __init__(
        self,
        config: EngineConfig,
        model,
        hf_config,
        tokenizer,
        device: torch.device,
        dtype: torch.dtype,
        tp_workers: TPWorkers | None = None,
    ) -> None:
        config = with_limits_for(config, device, hf_config)
        self.config = config
        self.tp_workers = tp_workers  # tensor parallel: this is rank 0 of the group
        self.model = model
        self.hf_config = hf_config
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len(config, hf_config)
        self.eos_token_ids = eos_token_ids(hf_config, tokenizer, generation_eos(config.model))
        num_kv_layers = getattr(model, "num_kv_layers", hf_config.num_hidden_layers)
        self.layout = KVLayout.of(model.kv_state, num_kv_layers, config.page_size, dtype)
        # allocated before the warm-up profile: its bytes count in the peak, so they come
        # out of what the KV pool may use
        self.state_pool = build_state_pool(model, config, dtype, device)
        self._profiled: set[int] = set()  # the warm-up steps' sizes run so far
        num_pages = plan_num_pages(
            config,
            self.layout,
            device,
            self._profile_forward,
            self._profile_sampler,
            peers=tp_workers,  # tensor parallel: the fewest pages any rank has room for
        )
        self._warm_linear_norms()
        self._check_pool_size(num_pages)
        # the host tier's budget: GiB of KV pages, and host slots of compressed state
        state_layout = None if self.state_pool is None else self.state_pool.layout
        page_gib, host_slots = split_host_budget(config, state_layout)
        backend = self._attention_backend()
        graphs_on = graphs_wanted(config, model, dtype, device, backend)
        if tp_workers is not None:  # each rank builds pools of the same pages and slots
            tp_workers.send(
                Setup(
                    num_pages=num_pages,
                    host_pages=HostPool.pages_in(self.layout, page_gib),
                    host_state_slots=host_slots,
                    eos_token_ids=tuple(self.eos_token_ids),
                    # decode takes the same path on every rank (decode_graphs.py)
                    attention_backend=backend,
                    graphs=graphs_on,
                )
            )
        self.pool = PagePool(self.layout, num_pages, device)
        # hybrid models: a prefix hit needs the recurrent state at the hit's last token,
        # which only the host tier's state checkpoints keep; without them nothing is cached
        checkpoints = config.host_kv_size_gib > 0 and config.state_checkpoint_interval > 0
        caching = config.enable_prefix_caching and (self.state_pool is None or checkpoints)
        allocator = PageAllocator(num_pages, caching)  # the KV manager's and the tier's
        self.state_slots = None if self.state_pool is None else StateSlots(config.max_num_seqs)
        self.checkpoints = None  # hybrid models' prefix hits, built with the tier
        self.tier = (
            self._build_tier(page_gib, host_slots, allocator)
            if config.host_kv_size_gib > 0
            else None
        )
        self.kv = KVCacheManager(allocator, config.page_size, self.tier, config.decode_append)
        self.exact_swap = None  # hybrid models' swap, over the state tier
        if self.tier is not None and self.tier.states is not None:
            self.exact_swap = ExactSwap(self.kv, self.tier.states, self.checkpoints)
        self._pipeline = config.pipeline_decode
        # async scheduling: the next step scheduled and launched while this one runs;
        # resolve() turned it off, with a warning, where it cannot run
        self._async = config.async_scheduling
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            self.eos_token_ids,
            admission=config.admission,
            state_slots=self.state_slots,
            exact_swap=self.exact_swap,
            checkpoints=self.checkpoints,
            # pipelined decode on one rank: a step's stores ahead (swap-outs' pages) are
            # submitted once its forward is launched, off the step's critical path
            # (TieredKVManager.flush); tensor parallel keeps them in the step's copy log
            defer_stores_ahead=(
                self.tier is not None and self._pipeline and not self._async and tp_workers is None
            ),
        )
        plan = decode_split_plan(
            config, model, self.layout, dtype, device, backend, self.max_model_len
        )
        graphs = None
        if graphs_on:
            graphs = build_decode_graphs(
                config,
                model,
                self.pool.layer_caches(),
                backend,
                plan,
                hf_config.hidden_size,
                device,
                dtype,
                self.max_model_len,
                copies=self.tier.copies if self.tier is not None else None,
                state_pool=self.state_pool,
            )
        runner_cls = ModelRunner if tp_workers is None else TPModelRunner
        self.runner = runner_cls(
            model,
            self.pool.layer_caches(),
            config.page_size,
            device,
            hf_config.vocab_size,
            self.eos_token_ids,
            debug=config.batchgen_debug,
            attention_backend=backend,
            graphs=graphs,
            split_plan=plan,
            max_num_seqs=config.max_num_seqs,
            max_pages=-(-self.max_model_len // config.page_size),
            seed=config.seed,
            linear_states=None if self.state_pool is None else self.state_pool.layer_states(),
            **({} if tp_workers is None else self._tp_runner_args()),
        )
        self.runner.warm_logits(config.max_step_rows, hf_config.hidden_size, dtype)
        self.detokenizer = Detokenizer(tokenizer)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._arrival = itertools.count()
        self._in_flight = None  # a queued decode step (pipelined decode)
        self._finished_early: list[Request] = []
        self._failed: dict[str, BaseException] = {}  # in this step: RequestsFailed
        self._num_sync = 0  # requests whose sampling needs the host's tokens each step
        self.grammar = None  # StructuredOutputs, built for the first constrained request
        logger.info("engine config: %s", config.describe())
        logger.info(
            "KV cache: %d pages of %d tokens (%.2f GiB) on %s",
            num_pages,
            config.page_size,
            self.pool.nbytes / 2**30,
            device,
        )

    def _tp_runner_args(self) -> dict:
        """TPModelRunner's extra arguments: the workers, and with the host tier the
        copies its steps hand them (the tier logs each copy it submits)."""
        if self.tier is None:
            return {"workers": self.tp_workers}
        return {"workers": self.tp_workers, "take_copies": self.tier.take_mirrored}

    def tier_worker_metrics(self) -> list[dict | None]:
        """Tensor parallel: each worker's host tier mirror counters (rank 1 first; None
        without the tier), once every copy rank 0 submitted has reached and left it."""
        if self.tp_workers is None:
            return []
        copies = self.tier.take_mirrored() if self.tier is not None else []
        return self.tp_workers.tier_metrics(copies)

    def _attention_backend(self) -> str:
        """The configured backend, where the model's attention has it: a model that
        lists its own in `attention_backends` is held to them, and "auto" falls back to
        torch for it."""
        backend = self.config.resolved_attention_backend(self.device)
        supported = getattr(self.model, "attention_backends", None)
        if supported is None or backend in supported:
            return backend
        if self.config.attention_backend == "auto":
            return "torch"
        raise ValueError(
            f"{type(self.model).__name__} has no {backend!r} attention backend "
            f"(it runs on {', '.join(supported)})"
        )

    def _build_tier(
        self, page_gib: float, host_slots: int, allocator: PageAllocator
    ) -> TieredKVManager:
        """The host tier over `page_gib` of KV pages and `host_slots` state slots (the
        split of host_kv_size_gib, split_host_budget), holding the device pool's
        `allocator` beside the KV manager."""
        pin = self.device.type == "cuda"
        host = HostPool.sized(self.layout, page_gib, pin=pin)
        self.tier_cost = self._tier_cost()
        copies = CopyEngine(self.device, issue=self.config.tier_copy_issue, background=True)
        metrics = TierMetrics()
        # tensor parallel: each copy submitted, logged for the workers' mirrors
        mirrored = None if self.tp_workers is None else []
        states = None
        if host_slots:  # hybrid models: requests swap with their compressed state
            states = StateTier(
                self.state_pool,
                HostStatePool(self.state_pool.layout, host_slots, pin=pin),
                self.state_slots,
                copies,
                metrics,
                debug=self.config.batchgen_debug,
                load_scatter=self.config.tier_load_scatter,
                mirror=None if mirrored is None else mirrored.append,
            )
        tier = TieredKVManager(
            self.pool,
            host,
            allocator,
            copies,
            debug=self.config.batchgen_debug,
            loads_pay=self.tier_cost["loads_pay"],
            load_scatter=self.config.tier_load_scatter,
            metrics=metrics,
            states=states,
            mirrored=mirrored,
        )
        if states is not None:
            if self.config.state_checkpoint_interval:  # what a seat per running request leaves
                self.checkpoints = StateCheckpoints(
                    states,
                    self.config.state_checkpoint_interval,
                    self.config.page_size,
                    max(host_slots - self.config.max_num_seqs, host_slots // 2, 1),
                    shared_only=self.config.state_checkpoint_policy == "shared",
                )
            logger.info(
                "host state tier: %d slots (%.2f GiB)",
                host_slots,
                states.host_pool.nbytes / 2**30,
            )
        elif self.state_pool is not None:
            logger.info("host state tier: no slot fits; preempted requests are recomputed")
        logger.info(
            "host KV tier: %d pages (%.2f GiB); %s",
            host.num_pages,
            host.nbytes / 2**30,
            "loads KV it holds" if tier.loads_pay else "idle: recomputing is cheaper",
        )
        return tier

    def _tier_cost(self) -> dict:
        """The cost rule: keep a token's KV on host and load it back when moving its
        bytes twice at the measured copy rate (the write-back the step waits for, then
        the load) takes less time than recomputing it at the measured prefill rate
        (tier_policy="always" loads regardless)."""
        per_token = self.layout.bytes_per_page / self.config.page_size
        num = min(self.config.max_num_batched_tokens, self.max_model_len - 1)
        if self.device.type != "cuda":
            num = min(num, 256)  # keeps a CPU start quick; tiny models are launch-bound
        recompute = recompute_seconds_per_token(self._profile_forward, num, self.device)
        load = per_token / copy_bytes_per_second(self.device)
        loads_pay = self.config.tier_policy == "always" or 2 * load < recompute
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

    def _check_pool_size(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages * self.config.page_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_pages * self.config.page_size} tokens, fewer than "
                f"max_model_len={self.max_model_len}: lower max_model_len or give the cache "
                "more memory"
            )

    def reconfigure(self, num_pages: int) -> None:
        """Free and re-create the device pool with num_pages pages between steps.

        Running requests are preempted first (their KV kept by the tier where it is
        active, else recomputed later); swapped requests and host prefixes survive; the
        device prefix cache starts empty. The old pool is released before the new one
        is allocated; if that allocation fails, a pool of the old size is re-created and
        the error raised, so the engine is never left without one. Under tensor parallel
        every rank re-creates its pool (the same page ids) once the tier copies of the
        preemptions reached it; a rank whose allocation fails sends them all back to the
        old size.
        """
        self._check_pool_size(num_pages)
        self._drain()
        for req in list(reversed(self.scheduler.running)):
            self.scheduler.running.remove(req)
            self.scheduler.preempt(req)
        if self.tier is not None:
            self.kv.keep_cached_on_host()
            self.kv.take_step_copies()  # nothing may stay queued against the old pool
            self.tier.drain()
        old_pages = self.pool.num_pages
        errors = []
        if self.tp_workers is not None:  # the workers first: they get the copies just made
            copies = self.tier.take_mirrored() if self.tier is not None else []
            errors = self.tp_workers.reconfigure(num_pages, copies)
        self._release_pool()
        # a worker that could not allocate: every rank stays at the old size
        wanted = old_pages if errors else num_pages
        self.pool, error = remake_pool(self.layout, wanted, old_pages, self.device)
        self._attach_pool()
        failure = "; ".join(errors) or error
        if failure:
            if self.tp_workers is not None:  # every rank back to the old page count
                self.tp_workers.reconfigure(old_pages, [])
            raise RuntimeError(
                f"reconfigure({num_pages}) could not allocate the KV pool ({failure}); "
                f"it was re-created with its previous {old_pages} pages"
            ) from error

    def _release_pool(self) -> None:
        """Drop every reference to the device pool so its memory can be freed."""
        self.runner.set_kv_caches([])
        if self.tier is not None:
            self.tier.attach_device(None, None)
        self.pool = None

    def _attach_pool(self) -> None:
        self.kv.resize(self.pool.num_pages)
        if self.tier is not None:
            self.tier.attach_device(self.pool, self.kv.allocator)
        self.runner.set_kv_caches(self.pool.layer_caches())

    @classmethod
    def from_config(cls, config: EngineConfig) -> EngineCore:
        from batchgen.models.default_model import default_model_path

        model = config.model or default_model_path(config.cache_dir)
        source = ModelSource.resolve(model, config.revision, config.cache_dir)
        # before the weights: a host tier that cannot fit would fail after loading them
        check_host_budget(config.host_kv_size_gib, config.tensor_parallel_size)
        with gguf_read_once():  # config, tokenizer and weights from one parse of a GGUF
            return cls._from_source(config, source)

    @classmethod
    def _from_source(cls, config: EngineConfig, source: ModelSource) -> EngineCore:
        hf_config = source.load_config()
        tokenizer = source.load_tokenizer()
        device = config.torch_device()
        # set here, before tensor-parallel workers take the config
        config = with_limits_for(config, device, hf_config)
        dtype = config.torch_dtype(source.checkpoint_dtype(hf_config), device)
        max_len = max_model_len(config, hf_config)
        if config.tensor_parallel_size == 1:
            model = build_model(
                source, hf_config, dtype, device, max_len, config.load_format, config.seed
            )
            return cls(config, model, hf_config, tokenizer, device, dtype)
        check_supported(config, device)
        check_tensor_parallel(hf_config, config.tensor_parallel_size)
        workers = TPWorkers.start(config, source)
        try:
            model = build_model(
                source,
                hf_config,
                dtype,
                device,
                max_len,
                config.load_format,
                config.seed,
                tp=workers.tp,
            )
            return cls(config, model, hf_config, tokenizer, device, dtype, workers)
        except BaseException:
            workers.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (a no-op otherwise)."""
        if self.tp_workers is not None:
            self.tp_workers.shutdown()
            self.tp_workers = None

    def _profile_forward(
        self, num_tokens: int, max_len: int | None = None, params: SamplingParams | None = None
    ) -> None:
        """A prefill step of num_tokens in prompts of at most max_len tokens (None: as
        long as max_model_len allows), each sampled with `params` (None: greedy)
        (warmup_forward), on every rank."""
        longest = self.max_model_len - 1 if max_len is None else max_len
        if self.tp_workers is not None:  # the workers run it too: collectives pair up
            self.tp_workers.send(Profile(num_tokens, longest, tuple(self.eos_token_ids)))
        backend = self._attention_backend()
        states = None if self.state_pool is None else self.state_pool.layer_states()
        warmup_forward(
            self.model,
            self.layout,
            self.device,
            self.hf_config,
            self.eos_token_ids,
            num_tokens,
            backend,
            linear_states=states,
            state_slot=self.config.max_num_seqs,  # the spare slot (build_state_pool)
            max_len=longest,
            params=params,
        )
        self._profiled.add(num_tokens)

    def _profile_sampler(self) -> None:
        """The memory plan's sampler step: as many one-token prompts as a step may hold
        rows (max_num_seqs), each sampled with every filter, penalty and logprobs
        (WIDEST_SAMPLING); a vocabulary-wide tensor or several a row."""
        self._profile_forward(self.config.max_step_rows, max_len=1, params=WIDEST_SAMPLING)

    def _warm_linear_norms(self) -> None:
        """On a GPU, a model with linear-attention layers runs a prefill step of each
        size norm_bucket_sizes names, so that fla-core autotunes its norms at build time
        rather than in the middle of a run (a first mixed step of a new size otherwise
        stalled W6 for 12-15 s on a fresh machine)."""
        if self.device.type != "cuda" or self.state_pool is None:
            return
        heads = self.state_pool.layout.num_heads
        for n in norm_bucket_sizes(self.config.max_num_batched_tokens, heads):
            if n not in self._profiled:  # the memory plan's own step counts
                self._profile_forward(n)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, what: str) -> None:
        """Raise ValueError naming `what` for a prompt the engine cannot run."""
        if not prompt_token_ids:
            raise ValueError(f"{what}: the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"{what}: the prompt has {len(prompt_token_ids)} tokens; "
                f"max_model_len is {self.max_model_len} (room is needed for output)"
            )
        vocab = self.hf_config.vocab_size
        # one pass over the ids for both checks: a W3-sized batch has millions of them
        bad = next((t for t in prompt_token_ids if type(t) is not int or not 0 <= t < vocab), None)
        if bad is not None:
            if type(bad) is not int:
                raise TypeError(f"{what}: token ids must be ints, got {bad!r}")
            raise ValueError(f"{what}: token id {bad} is outside the vocabulary [0, {vocab})")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"{what}: sampling params must be a SamplingParams, got {type(params)}")
        if params.n != 1 or params.best_of not in (None, 1):
            raise ValueError(
                f"{what}: the engine runs one sample per request (n={params.n}, "
                f"best_of={params.best_of}); LLM.generate and LLM.chat fan n > 1 out"
            )
        if params.structured_outputs is not None:
            try:
                self._grammar().compile(params.structured_outputs)
            except ValueError as e:
                raise ValueError(f"{what}: {e}") from e

    def _grammar(self):
        """The engine's StructuredOutputs (xgrammar is loaded on first use)."""
        if self.grammar is None:
            from batchgen.engine.structured import StructuredOutputs

            self.grammar = StructuredOutputs(
                self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids
            )
            self.runner.grammar = self.grammar
        return self.grammar

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        validated: bool = False,
    ) -> Request:
        """Queue one request. `validated`: the caller has already run validate() on these
        ids and params (LLM checks a whole call's prompts before adding any)."""
        if not validated:
            self.validate(prompt_token_ids, params, f"request {request_id}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = min(params.max_tokens or room, room)
        arrival = next(self._arrival)
        # an unseeded request gets a seed of its own: its draws depend on its arrival
        # index and step only, never on the batch (pipelined or not)
        seed = params.seed if params.seed is not None else request_seed(self.config.seed, arrival)
        req = Request(
            request_id, list(prompt_token_ids), params, max_tokens, arrival=arrival, seed=seed
        )
        if params.structured_outputs is not None:
            self._grammar().add(request_id, params.structured_outputs)
        self.kv.want(request_id, req.token_ids)
        self.requests[request_id] = req
        self._num_sync += _needs_sync(params)
        self.scheduler.add(req)
        self.stats.prompt_tokens += len(prompt_token_ids)
        return req

    def abort(self, request_ids) -> None:
        """Drop unfinished requests (e.g. after a failed step), releasing their pages."""
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is not None:
                self.scheduler.abort(req)
                self._num_sync -= _needs_sync(req.params)
            if self.grammar is not None:
                self.grammar.remove(rid)
        queued = self._in_flight
        if queued is not None and not any(
            r.request_id in self.requests for r in queued.sched.requests
        ):
            self._in_flight = None  # nothing left to read from it

    @property
    def has_unfinished(self) -> bool:
        """Whether step() has more to do or to hand out (requests a drained or failed
        step finished wait for the next step())."""
        return (
            self.scheduler.has_unfinished
            or self._in_flight is not None
            or bool(self._finished_early)
        )

    def step(self) -> list[Request]:
        """Run one step; returns the requests that finished in it (and any finished by
        a step drained early, e.g. by reconfigure()).

        Pipelined decode: when a step is a decode step and
        no request could be admitted, the next decode step is queued on the GPU (its
        input tokens read there) before this one's tokens reach the host, so the host's
        bookkeeping overlaps the GPU.
        A request that stops on a token it could not foresee (EOS, a stop string) has
        its queued extra token discarded.

        Raises RequestsFailed when the step failed for some requests only (their
        grammar raised on their token): they are dropped, the rest of the step stands."""
        finished = self._step()
        if self._finished_early:
            finished, self._finished_early = self._finished_early + finished, []
        if self._failed:
            failed, self._failed = self._failed, {}
            self._finished_early = finished  # handed out by the next step()
            self.abort(failed)
            raise RequestsFailed(failed)
        return finished

    def _step(self) -> list[Request]:
        if self.tier is not None:  # finished copies release their pages, pipelined or not
            self.kv.flush_ahead()  # none stays deferred past its step (defer_stores_ahead)
            with profiled("batchgen.tier_poll"):
                self.tier.poll()
        if self._async:
            return self._async_step()
        if self._in_flight is None:
            with record_function("batchgen.schedule"):
                sched = self.scheduler.schedule()
                copies = self.scheduler.take_copies()
            if sched.is_empty:
                return self._idle(sched)
            if not (self._pipeline and self.runner.can_launch_decode(sched, copies)):
                return self._finish_step(sched, self.runner.execute(sched, copies))
            self._in_flight = self.runner.launch_decode(sched, None, copies)
            self.kv.flush_ahead()  # the stores ahead schedule() deferred, behind the forward
        current = self._in_flight
        with profiled("batchgen.next_decode"):
            following = next_decode(current.sched, self.scheduler, self.kv, self.requests)
        if following is not None and not self.runner.can_launch_decode(*following):
            self.scheduler.unsend(following[0])
            following = None
        with profiled("batchgen.launch"):
            self._in_flight = None
            if following is not None:
                step, copies = following
                self._in_flight = self.runner.launch_decode(step, current, copies)
        with profiled("batchgen.wait_tokens"):
            result = current.result()
        finished = self._finish_step(current.sched, result)
        if self._in_flight is not None:  # its masks read the tokens just handed over
            with profiled("batchgen.launch_sample"):
                self._in_flight.launch_sample()
        return finished

    def _async_step(self) -> list[Request]:
        """Async scheduling: while the launched step runs, the next one is scheduled
        (a token still in flight is a placeholder the runner fills on the device) and
        launched; then the first one's tokens are applied. Steps are committed when
        launched (Scheduler.commit). A request that stops on a token it could not foresee
        (EOS, a stop string) has the next step's token discarded, as in pipelined decode.
        While a request needs each step's tokens on the host first (structured output)
        or prompt logprobs, steps run synchronously."""
        if self._in_flight is None:
            with record_function("batchgen.schedule"):
                sched = self.scheduler.schedule()
                copies = self.scheduler.take_copies()
            if sched.is_empty:
                return self._idle(sched)
            if self._num_sync:
                return self._finish_step(sched, self.runner.execute(sched, copies))
            self._in_flight = self._launch_committed(sched, copies, None)
        current, self._in_flight = self._in_flight, None
        if not self._num_sync:
            with profiled("batchgen.schedule_ahead"):
                following = self.scheduler.schedule()
                copies = self.scheduler.take_copies()
            if following.is_empty:
                self.scheduler.unsend(following)
            else:
                with profiled("batchgen.launch"):
                    self._in_flight = self._launch_committed(following, copies, current)
        with profiled("batchgen.wait_tokens"):
            result = current.result()
        return self._finish_step(current.sched, result)

    def _idle(self, sched: SchedulerOutput) -> list[Request]:
        """Nothing was scheduled: its released ids wait for the next step that runs;
        the tier's copies in flight are waited for, or nothing is left to schedule."""
        self.scheduler.unsend(sched)
        if self.tier is not None and self.tier.num_in_flight:
            self.tier.drain()
            return []
        if self.scheduler.waiting and not self.scheduler.running:
            raise RuntimeError("no request could be scheduled with an empty running set")
        return []

    def _launch_committed(self, sched: SchedulerOutput, copies: StepCopies, prev):
        flight = self.runner.launch_step(sched, prev, copies)
        self.scheduler.commit(sched, self.requests)
        return flight

    def _drain(self) -> None:
        """Finish a queued decode step now; its finished requests go out with the next
        step()."""
        if self._in_flight is not None:
            current, self._in_flight = self._in_flight, None
            self._finished_early += self._finish_step(current.sched, current.result())

    def _finish_step(self, sched: SchedulerOutput, result) -> list[Request]:
        with record_function("batchgen.update"):  # committed here, or at its launch (async)
            advanced = self.scheduler.update(sched, result, self.requests)
        self.stats.steps += 1
        self.stats.output_tokens += len(advanced)
        if self.grammar is not None:
            self._advance_grammars(advanced)
        finished = []
        for req in advanced:
            if req.request_id in self._failed:
                continue  # step() drops it
            if req.finish_reason in (None, "length"):  # a stop string beats the length limit
                stop = self.detokenizer.find_stop(req)
                if stop is not None:
                    self.scheduler.finish(req, "stop", stop)
            if req.is_finished:
                self.detokenizer.finalize(req)
                finished.append(self.requests.pop(req.request_id))
                self._num_sync -= _needs_sync(req.params)
                if self.grammar is not None:
                    self.grammar.remove(req.request_id)
        if self.tier is not None and not self.scheduler.has_unfinished:
            self.tier.drain()
        return finished

    def _advance_grammars(self, advanced: list[Request]) -> None:
        """Feed each constrained request's new token to its matcher. A token the grammar
        rejects can only come from another mask forbidding every token it allowed
        (min_tokens holding back the EOS of a complete grammar): the request stops.
        A matcher that raises fails its request alone (step() raises RequestsFailed): one
        call per request, so the others' matchers advance whatever one of them does."""
        rejected = []
        for req in advanced:
            try:
                rejected += self.grammar.advance([req.request_id], [req.output_token_ids[-1]])
            except Exception as e:
                self._failed[req.request_id] = e
        for rid in rejected:
            req = self.requests[rid]
            logger.warning(
                "request %s: its sampled token %d breaks its structured-output "
                "grammar (min_tokens beyond the grammar's end?); it stops here",
                rid,
                req.output_token_ids[-1],
            )
            self.scheduler.finish(req, "stop")

    def metrics(self) -> dict:
        """Counters for summaries: tokens, preemptions, prefix hits and host-tier traffic."""
        out = {
            "prompt_tokens": self.stats.prompt_tokens,
            "output_tokens": self.stats.output_tokens,
            "steps": self.stats.steps,
            "computed_tokens": self.scheduler.num_computed_tokens_total,
            "prefill_tokens_computed": self.scheduler.num_prompt_tokens_computed,
            "preemptions": self.scheduler.num_preemptions,
            "recomputes": self.scheduler.num_recomputes,
            "prefix_hit_tokens": self.kv.prefix_hit_tokens,
        }
        if self.checkpoints is not None:
            out["state_checkpoints"] = self.checkpoints.num_stored
            out["state_checkpoint_hit_tokens"] = self.checkpoints.hit_tokens
        if self.tier is not None:
            out.update(self.tier.metrics.summary())
            out.update({f"tier_{k}": v for k, v in self.tier_cost.items()})
        return out


def profiled(name: str):
    """A profiler range around a phase of the step, only while a profiler records (the
    hot loop pays one check otherwise)."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


def _needs_sync(params: SamplingParams) -> bool:
    """A request whose every step needs the previous step's tokens on the host (or
    reports what only a plain step computes): async scheduling runs steps synchronously
    for it. Penalties and logprobs do not: the runner keeps penalty counts on the device
    and copies logprobs to the host with the tokens."""
    return params.structured_outputs is not None or params.prompt_logprobs is not None
