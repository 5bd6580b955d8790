"""Engine configuration: one frozen dataclass of flat options, checked on creation by
the five groups it is made of (config_groups.py), and resolved once for the device the
engine runs on (`EngineConfig.resolve`)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields, replace

import torch

from batchgen.config_groups import (
    DTYPES,
    GROUPS,
    CacheConfig,
    DebugConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    group_fields,
)
from batchgen.kv_quant import kv_storage_dtype

logger = logging.getLogger(__name__)

# batch limits left unset (None), by device, as vLLM's offline LLM class sets them: a GPU
# of at least LARGE_GPU_GIB that is not an A100 takes the large ones
LARGE_GPU_GIB = 70
LARGE_GPU_LIMITS = (1024, 16384)  # (max_num_seqs, max_num_batched_tokens)
# a mixture-of-experts model's tokens a step under the large limits: its layers launch
# several times a dense layer's kernels (routing, sort, grouped GEMMs, combine; fla-core's
# KDA chunks in a hybrid), so at 16,384 tokens its prefill step waits on the host
MOE_LARGE_TOKENS = 32768
DEFAULT_LIMITS = (256, 8192)
# with deterministic=True a model with linear-attention layers prefills in pieces ending
# at multiples of this (the KDA kernels' chunk), from the sequence's start
DETERMINISTIC_CHUNK = 64
# the compressed-state slots of a model with linear-attention layers (one a row) take at
# most this share of the device memory under the large limits: rows are halved until they do
STATE_POOL_SHARE = 1 / 8


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the model itself. Frozen: a changed option is
    a new config (`dataclasses.replace`). The options are also reachable by concern, as
    frozen groups built from them (config_groups.py): `model_config`, `cache_config`,
    `scheduler_config`, `parallel_config`, `debug_config`.

    max_num_seqs and max_num_batched_tokens, left None, are set for the device when the
    engine is built (`with_batch_limits`): 1024 rows and 16,384 tokens a step on a GPU of
    at least 70 GiB that is not an A100 (as vLLM's offline LLM does: more rows a decode
    step for the same weight reads), else 256 and 8,192. A mixture-of-experts model takes
    32,768 tokens a step there: its prefill steps launch enough kernels from Python that
    at 16,384 tokens the GPU waits on the host (W4 +3.8%, W6 +7% on an H200). A model
    with linear-attention layers takes fewer rows there where its compressed-state slots
    (one a row, on the device) would take more than an eighth of the device memory: 512
    for W6's model (19.5 MB a row), 256 for one of Kimi-Linear-48B's size.

    max_queued_requests bounds the requests a call keeps in the engine unfinished
    (`read_ahead`; None: 4 x max_num_seqs): LLM.generate/chat add their prompts as earlier
    ones finish, as a batch job reads its lines.

    kv_cache_dtype "fp8" (or "fp8_e4m3", vLLM's names) stores K/V pages, and an MLA
    model's latent, as float8_e4m3fn, scaled by the checkpoint's KV scales where it ships
    them (layers/kv_scales.py), else by 1.0 (kv_quant.py): half
    the bytes a token of bf16 pages takes on the device, so twice the pages for the same
    memory, and half the bytes the host tier moves; "auto" keeps the compute dtype.

    kv_cache_size_gib, when set, fixes the device KV pool size; otherwise the pool
    takes gpu_memory_utilization of the device memory left after a warm-up forward
    (on the CPU: cpu_kv_cache_gib).

    pipeline_decode queues each decode step (penalised rows and rows reporting logprobs
    included: penalty counts live on the device, logprobs come back with the tokens)
    before the previous one's tokens reach the host (the host's bookkeeping then overlaps
    the GPU); outputs are the same either way. async_scheduling (off by default until
    measured on the GPU) extends that to every step, prefill chunks included: the next
    step is scheduled and launched while the current one runs (a request's token in
    flight read on the device), for requests with no structured output or prompt
    logprobs. Where it cannot run (pipeline_decode=False, batchgen_debug,
    decode_append="layer", tensor_parallel_size > 1) `resolve` turns it off with a
    warning naming the option. On models with linear-attention
    layers the state slots are read and written in stream order, and the host tier's
    state swaps and checkpoints are submitted between two launches, so they copy the
    state of the tokens committed so far.

    seed gives each request without a seed of its own one derived from it and the
    request's arrival index, so a run is reproducible and no request's draws depend on
    the batch (requests with a seed do not depend on it).

    admission orders the waiting requests: "prefix" admits first those whose prompt
    starts with pages already cached (longest first) and holds back a request whose next
    uncached page a running request is computing, so one computed prefix serves many
    requests; "arrival" admits in arrival order (what vLLM does).

    tier_policy decides when the host tier loads KV instead of recomputing it: "auto"
    loads (host prefix hits, swap-ins) only where moving a token's KV over the measured
    copy rate costs less than recomputing it at the measured prefill rate, and otherwise
    leaves the tier idle (no write-through, preemption recomputes); "always" loads and
    swaps whatever it costs.

    tier_copy_issue decides which thread issues the host tier's CUDA copies: "inline"
    (the thread that asks for the copy, except while a CUDA graph is captured; it spares
    the two threads' GIL hand-offs, which cost a host-bound run up to a tenth of its
    speed on an H200) or "worker" (a copy thread, overlapping the issuing with the main
    thread's GPU waits). Both keep the copy-ordering contract.

    tier_load_scatter decides where a load (swap-in, host prefix hit) scatters its staged
    pages into the device pool: "copy" on the copy stream that brought them over, or
    "compute" on the compute stream, each group of layers queued by the first wait of the
    forward that needs it (the forward still starts while later layers cross); with
    "compute" a write-through store's pages, and a hybrid model's state slots stored or
    checkpointed, are gathered on the compute stream too, as they are submitted, so that
    the tier runs no kernel on a copy stream: on an H200 the decode graphs replayed ~3%
    slower for the rest of a run once a kernel had run on another stream. (Tensor-parallel
    workers mirror the copies on their one copy stream whole, either way.)

    state_checkpoint_interval (tokens, a multiple of page_size; 0: off) gives models with
    linear-attention layers prefix hits: with the host tier on, a request's compressed
    state is copied to host each time its prefill reaches a multiple of it, and a later
    request whose prompt starts with the same tokens (its pages cached too) resumes from
    the longest such copy instead of computing that prefix. state_checkpoint_policy
    "shared" (the default) stores a position only where another request the engine holds
    (waiting or running) has the same prompt up to it; "all" stores every position, for
    prefixes shared by requests that come later (one request per generate() call).

    deterministic makes every row's arithmetic independent of the batch it runs in
    (layers/batch_invariant.py): products in row tiles of a fixed shape, attention over
    key blocks fixed by position, so a prompt's tokens and logprobs are the same bits
    alone, in any batch, prefilled in one step or many, after a prefix-cache hit or not,
    pipelined or not. The Triton backend attends with kernels/invariant_attention.py
    (keys never split by the batch; decode CUDA graphs and pipelined decode stay on),
    the torch one with batch_invariant.attend. Under tensor parallel every all-reduce
    adds the ranks' parts in rank order (layers/tp_group.py); expert parallel and
    attention data parallel run too. README's "Deterministic generation" says what is and is not covered.

    load_format "dummy" builds the model with random weights from its config alone (no
    checkpoint read): for benchmarks, as in vLLM.

    quantization "fp8" quantizes a float checkpoint's linear layers to block-scaled FP8
    (float8_e4m3fn, one scale per 128 x 128 block) as they load, as vLLM's option does;
    None (the default) keeps a checkpoint as it is stored: a block-scaled FP8 checkpoint's
    weights stay FP8 either way (models/quantization.py).

    cache_dir is where models are downloaded (vLLM's download_dir): the default model's
    GGUF (None: ~/.cache/batchgen) and, for a model named by its Hugging Face id, the hub
    cache its snapshot is looked up in and downloaded into (None: HF_HUB_CACHE, else
    huggingface_hub's default). revision is the branch, tag or commit of a Hugging Face id
    to load (None: "main"); a local path has no revisions and ignores it.
    """

    # each option's default is its group's (config_groups.py), defined there alone
    model: str | None = ModelConfig.model
    dtype: str = ModelConfig.dtype
    device: str = ModelConfig.device
    max_num_seqs: int | None = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int | None = SchedulerConfig.max_num_batched_tokens
    max_model_len: int | None = ModelConfig.max_model_len
    max_queued_requests: int | None = SchedulerConfig.max_queued_requests
    page_size: int = CacheConfig.page_size
    kv_cache_dtype: str = CacheConfig.kv_cache_dtype
    kv_cache_size_gib: float | None = CacheConfig.kv_cache_size_gib
    num_kv_pages: int | None = CacheConfig.num_kv_pages
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    cpu_kv_cache_gib: float = CacheConfig.cpu_kv_cache_gib
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    host_kv_size_gib: float = CacheConfig.host_kv_size_gib
    decode_append: str = CacheConfig.decode_append
    attention_backend: str = ModelConfig.attention_backend
    enforce_eager: bool = ModelConfig.enforce_eager
    pipeline_decode: bool = SchedulerConfig.pipeline_decode
    async_scheduling: bool = SchedulerConfig.async_scheduling
    cache_dir: str | None = ModelConfig.cache_dir
    revision: str | None = ModelConfig.revision
    seed: int = ModelConfig.seed
    deterministic: bool = ModelConfig.deterministic
    admission: str = SchedulerConfig.admission
    tier_policy: str = CacheConfig.tier_policy
    tier_copy_issue: str = CacheConfig.tier_copy_issue
    tier_load_scatter: str = CacheConfig.tier_load_scatter
    state_checkpoint_interval: int = CacheConfig.state_checkpoint_interval
    state_checkpoint_policy: str = CacheConfig.state_checkpoint_policy
    load_format: str = ModelConfig.load_format
    quantization: str | None = ModelConfig.quantization
    batchgen_debug: bool = DebugConfig.batchgen_debug
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size
    data_parallel_size: int = ParallelConfig.data_parallel_size
    enable_expert_parallel: bool = ParallelConfig.enable_expert_parallel
    distributed_executor_backend: str = ParallelConfig.distributed_executor_backend

    model_config: ModelConfig = field(init=False, repr=False, compare=False)
    cache_config: CacheConfig = field(init=False, repr=False, compare=False)
    scheduler_config: SchedulerConfig = field(init=False, repr=False, compare=False)
    parallel_config: ParallelConfig = field(init=False, repr=False, compare=False)
    debug_config: DebugConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # each group checks its own options (ValueError naming the option)
        for name, group in GROUPS:
            options = {f: getattr(self, f) for f in group_fields(group)}
            object.__setattr__(self, name, group(**options))

    def resolve(
        self, device: torch.device, state_bytes_per_seq: int = 0, moe: bool = False
    ) -> EngineConfig:
        """This config as the engine runs it on `device`: the batch limits left None set
        for the device and the model (`with_batch_limits`), and async_scheduling kept
        only where it can run; where it cannot, a warning names the option that rules it
        out and it is off (as vLLM turns off async scheduling it cannot use). Resolving
        a resolved config returns it unchanged. ValueError for enable_expert_parallel
        on a model without experts (`moe` False)."""
        if self.enable_expert_parallel and not moe:
            raise ValueError(
                "enable_expert_parallel=True needs a mixture-of-experts model "
                "(DeepSeek-V3, Kimi-K2, Kimi Linear); this model has no routed experts"
            )
        config = self.with_batch_limits(device, state_bytes_per_seq, moe)
        config.check_deterministic(linear_attention=state_bytes_per_seq > 0)
        self.check_kv_cache_dtype(device)
        blockers = self.async_blockers()
        if self.async_scheduling and blockers:
            logger.warning(
                "async_scheduling=True is not used with %s; steps run %s",
                " or ".join(blockers),
                "pipelined as before" if self.pipeline_decode else "one after another",
            )
            config = replace(config, async_scheduling=False)
        return config

    def check_deterministic(self, linear_attention: bool = False) -> None:
        """ValueError naming the option that deterministic=True cannot run with. Every
        parallel layout runs: tensor parallel's all-reduces add the ranks' parts in rank
        order (layers/tp_group.py), expert parallel's combine adds a token's expert rows
        in its routing order (its all-to-alls only move rows), so attention data
        parallel's ranks and `batchgen run --data-parallel N`'s separate engines give a
        request the bits one engine gives it (a tensor-parallel engine's bits are its
        own: its products are split otherwise, but no batch changes them). A model with `linear_attention` layers
        prefills in pieces aligned to DETERMINISTIC_CHUNK: its step budget must reach
        one, and its state checkpoints must sit on them."""
        if not self.deterministic:
            return
        if linear_attention:  # prefill pieces end at multiples of DETERMINISTIC_CHUNK
            interval = self.state_checkpoint_interval
            if self.max_num_batched_tokens < DETERMINISTIC_CHUNK or interval % DETERMINISTIC_CHUNK:
                raise ValueError(
                    "deterministic=True with linear-attention layers needs "
                    f"max_num_batched_tokens >= {DETERMINISTIC_CHUNK} and "
                    f"state_checkpoint_interval a multiple of it, got "
                    f"{self.max_num_batched_tokens} and {interval}"
                )

    def check_kv_cache_dtype(self, device: torch.device) -> None:
        """ValueError where FP8 KV cannot run on `device`: the Triton kernels read and
        write float8_e4m3fn with the conversions of GPUs of compute capability 8.9 and
        up (Ada, Hopper); an older GPU can use the torch path."""
        if self.kv_cache_dtype == "auto" or device.type != "cuda":
            return
        if self.attention_backend == "torch":
            return
        if torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} with the Triton attention kernels "
                "needs a GPU of compute capability 8.9 or newer (FP8 conversions); use "
                "attention_backend='torch' or kv_cache_dtype='auto'"
            )

    def kv_dtype(self, compute: torch.dtype) -> torch.dtype:
        """The dtype KV pages are stored in: `compute` (the model's compute dtype) under
        kv_cache_dtype "auto", else float8_e4m3fn."""
        return kv_storage_dtype(self.kv_cache_dtype, compute)

    def async_blockers(self) -> list[str]:
        """The options set here that async scheduling cannot run with: it needs
        pipelined decode, known tokens at every layer (decode_append="layer"'s per-layer
        hook), host-side checks (batchgen_debug) and one rank (tensor-parallel workers
        take steps as rank 0 executes them)."""
        blockers = []
        if not self.pipeline_decode:
            blockers.append("pipeline_decode=False")
        if self.batchgen_debug:
            blockers.append("batchgen_debug=True")
        if self.decode_append == "layer":
            blockers.append('decode_append="layer"')
        if self.tensor_parallel_size > 1:
            blockers.append(f"tensor_parallel_size={self.tensor_parallel_size}")
        return blockers

    def describe(self) -> str:
        """Every option by group, for the one log line of the config an engine runs."""
        groups = []
        for name, group in GROUPS:
            options = ", ".join(f"{f}={getattr(self, f)!r}" for f in group_fields(group))
            groups.append(f"{name.removesuffix('_config')}: {options}")
        return "; ".join(groups)

    def with_batch_limits(
        self, device: torch.device, state_bytes_per_seq: int = 0, moe: bool = False
    ) -> EngineConfig:
        """This config with max_num_seqs and max_num_batched_tokens set where they are
        None: the large limits on a GPU of at least LARGE_GPU_GIB that is not an A100,
        else the default ones. Under the large limits, a mixture-of-experts model (`moe`)
        takes MOE_LARGE_TOKENS tokens a step, and a model whose rows each hold
        `state_bytes_per_seq` bytes of compressed state on the device (a slot a running
        request) gets rows halved, down to the default's, until the slots take at most
        STATE_POOL_SHARE of the device memory."""
        if self.max_num_seqs is not None and self.max_num_batched_tokens is not None:
            return self
        seqs, tokens = DEFAULT_LIMITS
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            if props.total_memory >= LARGE_GPU_GIB * 2**30 and "A100" not in props.name:
                seqs, tokens = LARGE_GPU_LIMITS
                if moe:
                    tokens = MOE_LARGE_TOKENS
                share = props.total_memory * STATE_POOL_SHARE
                while seqs > DEFAULT_LIMITS[0] and seqs * state_bytes_per_seq > share:
                    seqs //= 2
        return replace(
            self,
            max_num_seqs=self.max_num_seqs or seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or tokens,
        )

    def resolved_attention_backend(self, device: torch.device) -> str:
        """'auto' is triton on a GPU when triton imports (deterministic too: its
        batch-invariant kernels), else the torch reference."""
        if self.attention_backend != "auto":
            return self.attention_backend
        if device.type != "cuda":
            return "torch"
        try:
            import triton  # noqa: F401

            from batchgen.layers import attention_triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"

    @property
    def max_step_rows(self) -> int:
        """The most rows one step can sample: a row a request, and a row takes at least
        a token of the step's budget (the limits set, see with_batch_limits)."""
        return min(self.max_num_seqs, self.max_num_batched_tokens)

    @property
    def read_ahead(self) -> int:
        """Engine requests a caller keeps added but unfinished: max_queued_requests, by
        default four steps' rows. LLM.generate and LLM.chat feed their prompts through
        this window as a batch job feeds its lines, so the two admit, batch and therefore
        compute a request alike, and the waiting queue stays bounded however many prompts
        a call has. Admission (prefix-first) and the host tier (a prefix queued requests
        want) see the requests in the window, not those beyond it."""
        return self.max_queued_requests or 4 * self.max_num_seqs

    @classmethod
    def field_names(cls) -> set[str]:
        """The options: the keyword arguments EngineConfig(...) takes (not its groups)."""
        return {f.name for f in fields(cls) if f.init}

    def torch_device(self) -> torch.device:
        """The device the engine runs on; ValueError where this torch cannot use it."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda":
            if not torch.backends.cuda.is_built():
                raise ValueError(
                    f"device={self.device!r} but this torch build has no CUDA support "
                    f"(torch {torch.__version__}); install a CUDA build of torch or use "
                    "device='cpu'"
                )
            count = torch.cuda.device_count()
            if (device.index or 0) >= count:
                raise ValueError(
                    f"device={self.device!r} but torch sees {count} CUDA device(s) "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                    "use a visible device or device='cpu'"
                )
        return device

    def torch_dtype(self, model_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
        """The compute dtype: explicit, else the checkpoint's on a GPU, float32 on the CPU."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if device.type == "cpu":
            return torch.float32
        if model_dtype in (torch.float16, torch.bfloat16):
            return model_dtype
        return torch.bfloat16
