"""EngineConfig's options in five frozen groups, each checking its own options.

EngineConfig (config.py) takes every option flat, as LLM(...) and vLLM users pass them,
and builds these groups from its fields: `config.model_config`, `config.cache_config`,
`config.scheduler_config`, `config.parallel_config`, `config.debug_config`. A component
that needs the options of one concern can be handed its group alone. Each option's
default is defined here, and EngineConfig's flat field takes it. Each group raises
ValueError naming the option a value is wrong for; checks that span groups (async
scheduling against debug, decode_append and tensor parallel) are EngineConfig.resolve's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from batchgen.kv_quant import KV_CACHE_DTYPES

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
# EngineConfig.quantization's values besides None: quantized as the checkpoint loads
QUANTIZATIONS = ("fp8",)


def _positive_int(group: object, *names: str, optional: bool = False) -> None:
    for name in names:
        v = getattr(group, name)
        if optional and v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


# the values of each option that names a choice: the groups check them, and so does each
# component taking one as a constructor argument (check_choice), whoever built it
CHOICES: dict[str, tuple[str, ...]] = {
    "load_format": ("auto", "dummy"),
    "attention_backend": ("auto", "torch", "triton"),
    "decode_append": ("off", "batched", "layer"),
    "tier_policy": ("auto", "always"),
    "tier_copy_issue": ("worker", "inline"),
    "tier_load_scatter": ("copy", "compute"),
    "state_checkpoint_policy": ("shared", "all"),
    "admission": ("prefix", "arrival"),
    "distributed_executor_backend": ("mp", "ray"),
    "kv_cache_dtype": KV_CACHE_DTYPES,
}


def check_choice(option: str, value: object) -> None:
    """ValueError naming the option and its choices unless `value` is one of them."""
    allowed = CHOICES[option]
    if value not in allowed:
        choices = ", ".join(repr(a) for a in allowed[:-1]) + f" or {allowed[-1]!r}"
        raise ValueError(f"{option} must be {choices}, got {value!r}")


def check_checkpoint_interval(interval: object, page_size: int) -> None:
    """state_checkpoint_interval: 0 (no checkpoints) or a positive multiple of page_size."""
    if not isinstance(interval, int) or interval < 0 or interval % page_size:
        raise ValueError(
            f"state_checkpoint_interval must be 0 or a positive multiple of page_size "
            f"({page_size}), got {interval!r}"
        )


def _one_of(group: object, *names: str) -> None:
    for name in names:
        check_choice(name, getattr(group, name))


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how to run it: model, revision and cache_dir (where it comes
    from), load_format ("dummy": random weights from the config alone, for benchmarks),
    quantization (None, or "fp8": a float checkpoint's linear layers quantized to
    block-scaled FP8 as they load),
    dtype and device ("auto": see EngineConfig.torch_dtype / torch_device),
    max_model_len, attention_backend ("auto": see EngineConfig.resolved_attention_backend),
    enforce_eager (no CUDA graphs), seed (the dummy weights' and each request's default
    sampling seed) and deterministic (batch-invariant layers: see EngineConfig)."""

    model: str | None = None
    revision: str | None = None
    cache_dir: str | None = None
    load_format: str = "auto"
    quantization: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    attention_backend: str = "auto"
    enforce_eager: bool = False
    seed: int = 0
    deterministic: bool = False

    def __post_init__(self) -> None:
        _positive_int(self, "max_model_len", optional=True)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu") and not str(self.device).startswith("cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        _one_of(self, "attention_backend", "load_format")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            choices = " or ".join(repr(q) for q in QUANTIZATIONS)
            raise ValueError(f"quantization must be None or {choices}, got {self.quantization!r}")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be True or False, got {self.deterministic!r}")
        if self.revision is not None and not (isinstance(self.revision, str) and self.revision):
            raise ValueError(
                f"revision must be None or a branch, tag or commit, got {self.revision!r}"
            )


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache on the device and the host tier behind it: pages (page_size,
    num_kv_pages or kv_cache_size_gib, else gpu_memory_utilization of what the warm-up
    leaves; cpu_kv_cache_gib on the CPU), kv_cache_dtype ("auto": the compute dtype;
    "fp8"/"fp8_e4m3": float8_e4m3fn pages, kv_quant.py), enable_prefix_caching, and the host tier
    (host_kv_size_gib, decode_append, tier_policy, tier_copy_issue, tier_load_scatter,
    state_checkpoint_interval and state_checkpoint_policy: EngineConfig says each)."""

    page_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_size_gib: float | None = None
    num_kv_pages: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    host_kv_size_gib: float = 0.0
    decode_append: str = "off"
    tier_policy: str = "auto"
    tier_copy_issue: str = "inline"
    tier_load_scatter: str = "copy"
    state_checkpoint_interval: int = 1024
    state_checkpoint_policy: str = "shared"

    def __post_init__(self) -> None:
        _positive_int(self, "page_size")
        _positive_int(self, "num_kv_pages", optional=True)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.kv_cache_size_gib is not None and self.kv_cache_size_gib <= 0:
            raise ValueError(f"kv_cache_size_gib must be > 0, got {self.kv_cache_size_gib!r}")
        if self.host_kv_size_gib < 0:
            raise ValueError(f"host_kv_size_gib must be >= 0, got {self.host_kv_size_gib!r}")
        if self.host_kv_size_gib > 0 and not self.enable_prefix_caching:
            raise ValueError(
                "host_kv_size_gib needs enable_prefix_caching=True: host pages are found by "
                "the prefix cache's page hashes"
            )
        check_checkpoint_interval(self.state_checkpoint_interval, self.page_size)
        _one_of(
            self,
            "decode_append",
            "tier_policy",
            "tier_copy_issue",
            "tier_load_scatter",
            "state_checkpoint_policy",
            "kv_cache_dtype",
        )
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """What a step holds and how steps follow one another: max_num_seqs and
    max_num_batched_tokens (None: set for the device by EngineConfig.resolve),
    max_queued_requests, admission, pipeline_decode and async_scheduling."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_queued_requests: int | None = None
    admission: str = "prefix"
    pipeline_decode: bool = True
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        _positive_int(
            self, "max_num_seqs", "max_num_batched_tokens", "max_queued_requests", optional=True
        )
        _one_of(self, "admission")


@dataclass(frozen=True)
class ParallelConfig:
    """tensor_parallel_size: the processes (one a GPU) the model is split over.
    data_parallel_size with enable_expert_parallel (vLLM's names), on a mixture-of-experts
    model: attention data parallel, that many ranks in one engine, each running its own
    share of the requests over its own KV pages, their MoE layers run together
    (engine/dp_attention.py). Without enable_expert_parallel, data parallel is the Ray
    engines of `batchgen run --data-parallel` (api/data_parallel.py).
    enable_expert_parallel with tensor_parallel_size > 1: the MoE layers' routed experts
    placed by rank over the tensor-parallel ranks, tokens sent to their experts' ranks
    and back by all-to-all (layers/expert_parallel.py) instead of every rank computing
    its experts' share of every token and an all-reduce. It needs more than one rank
    (tensor or data parallel) and a MoE model (EngineConfig.resolve checks the model).
    distributed_executor_backend (vLLM's name) starts the ranks past rank 0 (this
    process): "mp" as processes of this host, "ray" as Ray actors placed over the hosts
    of a Ray cluster, one engine across them (distributed/ray_ranks.py; Ray is an
    optional extra)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_executor_backend: str = "mp"

    def __post_init__(self) -> None:
        _positive_int(self, "tensor_parallel_size", "data_parallel_size")
        _one_of(self, "distributed_executor_backend")
        ranks = self.tensor_parallel_size * self.data_parallel_size
        if self.enable_expert_parallel and ranks < 2:
            raise ValueError(
                "enable_expert_parallel=True spreads experts over ranks: it needs "
                "tensor_parallel_size or data_parallel_size > 1, got "
                f"{self.tensor_parallel_size} and {self.data_parallel_size}"
            )


@dataclass(frozen=True)
class DebugConfig:
    """batchgen_debug: offloaded pages read back and compared, KV pages and logits
    checked for NaN/Inf, errors naming the request, layer and page."""

    batchgen_debug: bool = False


# in the order EngineConfig checks them: its first error is the first group's
GROUPS = (
    ("parallel_config", ParallelConfig),
    ("scheduler_config", SchedulerConfig),
    ("model_config", ModelConfig),
    ("cache_config", CacheConfig),
    ("debug_config", DebugConfig),
)


def group_fields(group: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(group))
