"""Memory planning for the device KV pool, and the host heap during a run."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch

from batchgen.config import EngineConfig
from batchgen.kv.layout import KVLayout
from batchgen.kv.page_pool import PagePool
from batchgen.kv.state_pool import StateLayout, StatePool
from batchgen.runner.batch import NewRequest, ScheduledRequest, SchedulerOutput
from batchgen.runner.model_runner import ModelRunner
from batchgen.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# what the memory plan's sampler step asks of every row: each filter, each penalty and
# the most logprobs a request may report, so that its peak is the sampler's widest
WIDEST_SAMPLING = SamplingParams(
    temperature=1.0,
    top_p=0.9,
    top_k=50,
    min_p=0.01,
    logprobs=20,
    presence_penalty=0.5,
    frequency_penalty=0.5,
    repetition_penalty=1.1,
)


def check_host_budget(
    gib: float,
    ranks: int = 1,
    meminfo: str = "/proc/meminfo",
    cgroup: str = "/sys/fs/cgroup",
) -> None:
    """ValueError, before anything is loaded, when a host tier of `gib` GiB on each of
    `ranks` ranks cannot fit in the memory this process may still take: Linux's
    MemAvailable, or what is left under its cgroup's (v2) memory.max if less. Pinning
    more than that fails late (after the weights are loaded) or gets the process killed
    as the pages are touched. Where neither can be read, nothing is checked."""
    if gib <= 0:
        return
    left = [v for v in (_mem_available(meminfo), _cgroup_left(cgroup)) if v is not None]
    if not left:
        return
    need = gib * ranks * 2**30
    if need > min(left):
        per = f" on each of {ranks} tensor-parallel ranks" if ranks > 1 else ""
        raise ValueError(
            f"host_kv_size_gib={gib:g}{per} needs {need / 2**30:.1f} GiB of host memory, "
            f"but this process can take {min(left) / 2**30:.1f} GiB more: lower "
            "host_kv_size_gib (--host-kv-gib)"
        )


def _mem_available(meminfo: str) -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where unreadable)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_left(cgroup: str) -> int | None:
    """memory.max - memory.current of a cgroup v2 directory, in bytes (None where the
    files are missing or the limit is "max")."""
    try:
        limit = Path(cgroup, "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int(Path(cgroup, "memory.current").read_text()))
    except (OSError, ValueError):
        return None


class PlanPeers(Protocol):
    """The other ranks of a tensor-parallel group, as the memory plan sees them: each
    starts counting its own peak (`plan_begin`), runs the warm-up steps rank 0's
    profile sends it, then answers the pages its own GPU has left (`plan_pages`)."""

    def plan_begin(self) -> None: ...

    def plan_pages(self) -> list[int]: ...


def plan_num_pages(
    config: EngineConfig,
    layout: KVLayout,
    device: torch.device,
    profile_forward: Callable[[int], None],
    profile_sampler: Callable[[], None] | None = None,
    peers: PlanPeers | None = None,
    reserve: int = 0,
) -> int:
    """Pages for the pool: fixed by config, else a fraction of what a warm-up forward
    at the largest token budget leaves free on the GPU (cpu_kv_cache_gib on the CPU).
    `profile_sampler`, run after it, counts the sampler's peak at its widest (a step of
    max_num_seqs rows, each filtered and reporting logprobs): a prefill step samples a
    few rows, a later mixed or decode step hundreds, each a vocabulary wide. `reserve`:
    bytes held later that no warm-up step measures (the sampling decode graphs',
    `graph_sampling.sampling_graph_reserve`), kept out of this rank's pages.

    `peers` (tensor parallel): every rank holds the same pages (of its own heads), so
    the pool gets the fewest that any rank's GPU has left after the same warm-up."""
    if config.num_kv_pages is not None:
        return config.num_kv_pages
    if config.kv_cache_size_gib is not None:
        return int(config.kv_cache_size_gib * 2**30 // layout.bytes_per_page)
    if device.type != "cuda":
        return int(config.cpu_kv_cache_gib * 2**30 // layout.bytes_per_page)
    if peers is not None:
        peers.plan_begin()
    begin_peak(device)
    profile_forward(config.max_num_batched_tokens)
    if profile_sampler is not None:
        profile_sampler()
    pages = pages_left(config, layout, device, reserve)
    others = [] if peers is None else peers.plan_pages()
    if not others:  # no other rank
        return pages
    logger.info("memory plan: pages each rank's GPU has left, rank 0 first: %s", [pages, *others])
    return min(pages, *others)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's weights occupy on its device: the storage of its parameters
    and buffers (quantized weights, their scales and derived copies, such as a router's
    narrow one, included), each storage counted once (tied embeddings share one). The
    memory plan needs no figure from here: the weights are allocated before its
    warm-up steps, so the peak it measures (`pages_left`) already counts their real
    bytes, whatever their precision."""
    seen: dict[object, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_meta:  # no storage to share: the tensor's own size
            seen[id(t)] = t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        seen[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def begin_peak(device: torch.device) -> None:
    """Start a memory plan's count: what is cached but unused goes back, and the peak
    counts from here."""
    # an engine dropped with reference cycles still holds its pool until collected
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def pages_left(
    config: EngineConfig, layout: KVLayout, device: torch.device, reserve: int = 0
) -> int:
    """Once the warm-up steps have run since begin_peak: the pages of `layout` that fit
    in gpu_memory_utilization of the GPU, less the steps' peak, `reserve` bytes held
    later outside it, and what other processes (or memory outside torch's allocator,
    such as NCCL's) hold."""
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    in_use_elsewhere = total - free - torch.cuda.memory_reserved(device)
    budget = total * config.gpu_memory_utilization - peak - reserve - in_use_elsewhere
    torch.cuda.empty_cache()
    pages = int(budget // layout.bytes_per_page)
    logger.info(
        "memory plan: peak %.2f GiB during warm-up, %.2f GiB reserved, %.2f GiB for KV",
        peak / 2**30,
        reserve / 2**30,
        pages * layout.bytes_per_page / 2**30,
    )
    return max(pages, 0)


def remake_pool(
    layout: KVLayout, num_pages: int, old_pages: int, device: torch.device
) -> tuple[PagePool, Exception | None]:
    """reconfigure()'s new device pool, once every reference to the old one is dropped:
    the old pool's memory given back, then a pool of num_pages pages (torch.zeros:
    rule 4); where that allocation fails, one of old_pages pages, and the error. On a
    GPU a collection first frees an old pool held in reference cycles; host memory is
    not that scarce, and a full collection cost ~0.3-0.6 s a reconfigure on the CPU."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    try:
        return PagePool(layout, num_pages, device), None
    except (RuntimeError, MemoryError) as e:
        return PagePool(layout, old_pages, device), e


def state_layout(model, dtype: torch.dtype) -> StateLayout | None:
    """The compressed-state slot geometry of a model's linear-attention (KDA) layers
    (`model.linear_layers`, in state-index order), or None for a model without any."""
    layers = list(getattr(model, "linear_layers", None) or [])
    if not layers:
        return None
    first = layers[0]
    return StateLayout(
        num_layers=len(layers),
        num_heads=first.num_heads,
        head_k_dim=first.head_dim,
        head_v_dim=first.head_dim,
        conv_dim=first.conv_dim,
        conv_kernel=first.conv_kernel,
        conv_dtype=dtype,  # the window holds the projections' outputs
    )


def build_state_pool(
    model, config: EngineConfig, dtype: torch.dtype, device: torch.device
) -> StatePool | None:
    """The compressed-state pool of a model with linear-attention (KDA) layers, None for
    one without: a slot per running request (max_num_seqs) and a spare no request takes
    (the warm-up forward's, and padding rows' of captured decode graphs). The engine
    allocates it before the warm-up profile, so its bytes count in the peak and come out
    of what the KV pool may use."""
    layout = state_layout(model, dtype)
    if layout is None:
        return None
    pool = StatePool(layout, config.max_num_seqs + 1, device)
    logger.info(
        "compressed state: %d slots of %d KDA layers (%.2f GiB); prefix caching off",
        pool.num_slots,
        layout.num_layers,
        pool.nbytes / 2**30,
    )
    return pool


CHECKPOINT_SLOTS_PER_SEAT = 3  # host state slots for checkpoints per max_num_seqs seat


def split_host_budget(config: EngineConfig, layout: StateLayout | None) -> tuple[float, int]:
    """The host tier's host_kv_size_gib split into (GiB for KV pages, host state slots).
    A model with linear-attention layers gets a host slot per running request
    (max_num_seqs: every running request can be swapped at once) and, with state
    checkpoints on, CHECKPOINT_SLOTS_PER_SEAT more per seat for them; fewer where those
    would take more than half the budget; the pages get the rest. With no slot at all,
    its preempted requests are recomputed."""
    gib = config.host_kv_size_gib
    if layout is None:
        return gib, 0
    per_slot = layout.bytes_per_slot
    seats = config.max_num_seqs
    if config.state_checkpoint_interval:
        seats *= 1 + CHECKPOINT_SLOTS_PER_SEAT
    slots = min(seats, int(gib * 2**30 / 2 // per_slot))
    return gib - slots * per_slot / 2**30, slots


def warmup_forward(
    model,
    layout: KVLayout,
    device: torch.device,
    hf_config,
    eos_token_ids,
    num_tokens: int,
    attention_backend: str = "torch",
    linear_states: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    state_slot: int | None = None,
    max_len: int | None = None,
    params: SamplingParams | None = None,
) -> None:
    """One prefill step of num_tokens prompt tokens through a throw-away pool, on the
    attention backend the engine runs: the peak memory of the largest step, for
    plan_num_pages, and its time, for the tier's cost rule. The tokens are prompts of
    at most `max_len` tokens each (None: one prompt), as a full step of a model whose
    context is shorter than the step's token budget holds several; each samples with
    `params` (None: greedy). A model with
    linear-attention layers runs on the engine's state pool (`linear_states`), every
    prompt in `state_slot`, a slot no request holds (the layers zero it first; what the
    prompts leave there is never read)."""
    lens = prompt_lengths(num_tokens, max_len)
    per = [-(-n // layout.page_size) for n in lens]
    pool = PagePool(layout, sum(per) + 1, device)
    runner = ModelRunner(
        model,
        pool.layer_caches(),
        layout.page_size,
        device,
        hf_config.vocab_size,
        eos_token_ids,
        attention_backend=attention_backend,
        max_num_seqs=len(lens),
        max_pages=max(per),
        linear_states=linear_states,
    )
    params = SamplingParams(temperature=0) if params is None else params
    requests, first = [], 0
    for i, (n, pages) in enumerate(zip(lens, per)):
        prompt = [0] * n
        page_ids = list(range(first, first + pages))
        new = NewRequest(params, prompt, [], i)
        requests.append(
            ScheduledRequest(f"profile{i}", prompt, 0, page_ids, True, 0, state_slot, new)
        )
        first += pages
    runner.execute(SchedulerOutput(requests))


def prompt_lengths(num_tokens: int, max_len: int | None) -> list[int]:
    """num_tokens as prompts of at most max_len tokens (None: one prompt), the longest
    first."""
    if max_len is None or num_tokens <= max_len:
        return [num_tokens]
    full, rest = divmod(num_tokens, max_len)
    return [max_len] * full + ([rest] if rest else [])


NORM_BUCKET_ROWS = 2048 * 32  # fla-core's norms: NB = cdiv(rows, 2048 * 32)


def norm_bucket_sizes(max_tokens: int, linear_heads: int) -> list[int]:
    """Step sizes that meet every autotuning bucket of fla-core's l2norm and gated
    output norm (their NB key: a bucket per NORM_BUCKET_ROWS rows of head_dim, a token
    giving one row a head) up to max_tokens: the largest size of each bucket, capped at
    max_tokens. A step of a new bucket otherwise autotunes those kernels mid-run (seconds
    on a machine whose Triton cache lacks them)."""
    per_bucket = max(1, NORM_BUCKET_ROWS // max(linear_heads, 1))
    # only the last bucket's end can pass max_tokens: capping it makes no duplicate
    return [min(b, max_tokens) for b in range(per_bucket, max_tokens + per_bucket, per_bucket)]


def recompute_seconds_per_token(
    profile_forward: Callable[[int], None], num_tokens: int, device: torch.device
) -> float:
    """Seconds a prefill forward of num_tokens spends per token: the second of two runs
    (the first compiles and warms up), for the host tier's cost rule."""
    profile_forward(num_tokens)
    _sync(device)
    start = time.perf_counter()
    profile_forward(num_tokens)
    _sync(device)
    return (time.perf_counter() - start) / num_tokens


def copy_bytes_per_second(device: torch.device, nbytes: int = 64 * 2**20) -> float:
    """Host->device bandwidth of one large copy from pinned memory (a plain memory copy
    on the CPU), for the host tier's cost rule."""
    cuda = device.type == "cuda"
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=cuda)
    _sync(device)
    start = time.perf_counter()
    for _ in range(3):
        dev.copy_(host, non_blocking=cuda)
    _sync(device)
    return 3 * nbytes / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# the oldest generation's threshold while a run adds requests and runs steps
RUN_FULL_COLLECTION_THRESHOLD = 100
# the youngest generation's threshold there (Python's is 700 allocations)
RUN_YOUNG_COLLECTION_THRESHOLD = 20_000


@contextmanager
def fewer_full_collections() -> Iterator[None]:
    """Python's cyclic collector walks every tracked object in a full collection; with
    the heap an engine process holds each took tens of milliseconds, and adding a
    batch's requests made enough objects to start several (512 W4 requests took 0.26 s
    to add on a 2-core CPU, 0.07 s with the collector off). Inside, a full collection
    waits for RUN_FULL_COLLECTION_THRESHOLD collections of the middle generation instead
    of Python's 10 (the oldest threshold raised, never lowered; restored on exit): 0.075 s
    for the same requests. The youngest generation is collected after
    RUN_YOUNG_COLLECTION_THRESHOLD allocations instead of 700: a step's per-row objects
    (~900 rows of a chat job) then mostly die before a collection would have promoted
    them, and the middle generation fills less often (W7's host time a step on the CPU
    probe, 5.7 -> 5.1 ms). Garbage made during the run is still freed by the young
    collections. (gc.freeze, vLLM's answer in its engine process, left the garbage alive
    on entry uncollected through the run: a suite of engines built one after another
    grew by gigabytes.)"""
    t0, t1, t2 = gc.get_threshold()
    gc.set_threshold(
        max(t0, RUN_YOUNG_COLLECTION_THRESHOLD), t1, max(t2, RUN_FULL_COLLECTION_THRESHOLD)
    )
    try:
        yield
    finally:
        gc.set_threshold(t0, t1, t2)
