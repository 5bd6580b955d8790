"""The warm-up forward that memory planning measures on a GPU also runs on the CPU: a
full step of the token budget, in prompts as long as max_model_len allows."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import save_tiny_model

import batchgen.engine.memory as memory
from batchgen import LLM
from batchgen.config import EngineConfig
from batchgen.engine.memory import warmup_forward
from batchgen.forward_context import get_forward_context
from batchgen.kv.state_pool import StateLayout
from batchgen.layers import attention, attention_torch


def small_engine(path, max_num_seqs: int, max_num_batched_tokens: int = 100):
    """The engine of an LLM on the CPU over the model saved at path: fp32, a 64-token
    context, 100 tokens a step unless told."""
    llm = LLM(
        model=str(path),
        device="cpu",
        dtype="float32",
        max_model_len=64,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    return llm.engine


def test_warmup_forward_runs_a_full_budget_step(tmp_path, monkeypatch):
    save_tiny_model(tmp_path, "Qwen3ForCausalLM")
    llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", page_size=4, max_model_len=64)
    eng = llm.engine
    pools, forwards = [], []

    class SpiedPool(memory.PagePool):  # the throw-away pools the warm-up builds
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pools.append(self)

    monkeypatch.setattr(memory, "PagePool", SpiedPool)
    # the torch reference under two more names: the forward context says which one ran
    monkeypatch.setitem(attention._BACKENDS, "asked", attention_torch)
    monkeypatch.setitem(attention._BACKENDS, "engine's", attention_torch)
    monkeypatch.setattr(eng.warmup, "backend", "engine's")

    def seen(_, args):
        forwards.append((args[0].shape, get_forward_context().attention_backend))

    hook = eng.model.register_forward_pre_hook(seen)
    free = eng.kv.num_free_pages
    torch.manual_seed(0)
    eng.pool.kv.normal_()  # non-zero everywhere: any write shows
    engine_kv = eng.pool.kv.clone()

    layout, hf_config, eos = eng.layout, eng.hf_config, eng.eos_token_ids
    warmup_forward(eng.model, layout, eng.device, hf_config, eos, 37, attention_backend="asked")
    eng.warmup.forward(150)  # prompts of 63, 63 and 24: max_model_len is 64
    hook.remove()

    # one forward of the requested number of tokens each, on the backend asked for
    assert forwards == [(torch.Size([37]), "asked"), (torch.Size([150]), "engine's")]
    # each wrote the KV of exactly those tokens into its own pool, and nothing else: the
    # second's three prompts from the first token slot of pages 0, 16 and 32
    assert len(pools) == 2
    for pool, prompts in zip(pools, ([(0, 37)], [(0, 63), (64, 63), (128, 24)])):
        assert pool.kv is not eng.pool.kv
        slots = pool.kv.flatten(2, 3).abs().amax(dim=(0, 1, 3, 4))  # per token slot
        written = torch.zeros_like(slots, dtype=torch.bool)
        for first, n in prompts:
            written[first : first + n] = True
        assert torch.equal(slots > 0, written)
    # the engine's own pool is bit-for-bit untouched, its pages all still free
    assert torch.equal(eng.pool.kv, engine_kv)
    assert eng.kv.num_free_pages == free


def test_the_host_budget_gives_hybrid_models_a_state_slot_per_seat():
    layout = StateLayout(2, 2, 4, 4, 6, 4, torch.float32)  # 2 * (256 + 72) bytes a slot
    per = layout.bytes_per_slot
    config = EngineConfig(host_kv_size_gib=1.0, max_num_seqs=8, state_checkpoint_interval=0)
    assert memory.split_host_budget(config, None) == (1.0, 0)
    gib, slots = memory.split_host_budget(config, layout)
    assert slots == 8 and gib == 1.0 - 8 * per / 2**30
    small = EngineConfig(
        host_kv_size_gib=7 * per / 2**30, max_num_seqs=8, state_checkpoint_interval=0
    )
    gib, slots = memory.split_host_budget(small, layout)  # at most half the budget
    assert slots == 3 and abs(gib * 2**30 - 4 * per) < 1e-6
    # state checkpoints (on by default) get three more slots per seat
    gib, slots = memory.split_host_budget(
        EngineConfig(host_kv_size_gib=1.0, max_num_seqs=8), layout
    )
    assert slots == 32 and gib == 1.0 - 32 * per / 2**30


def test_a_step_is_cut_into_prompts_no_longer_than_allowed():
    assert memory.prompt_lengths(150, 63) == [63, 63, 24]
    assert memory.prompt_lengths(126, 63) == [63, 63]
    assert memory.prompt_lengths(40, 63) == [40]
    assert memory.prompt_lengths(40, None) == [40]


def test_norm_buckets_are_each_met_once_up_to_the_budget():
    # 16 heads: a bucket per 4,096 tokens (65,536 rows of head_dim)
    assert memory.norm_bucket_sizes(16384, 16) == [4096, 8192, 12288, 16384]
    assert memory.norm_bucket_sizes(10000, 16) == [4096, 8192, 10000]
    assert memory.norm_bucket_sizes(16384, 32) == [2048 * i for i in range(1, 9)]
    assert memory.norm_bucket_sizes(1000, 2) == [1000]  # one bucket holds it all


def test_a_hybrid_engine_warms_each_norm_bucket_on_a_gpu(tmp_path, monkeypatch):
    """On a GPU the engine runs a warm-up step of each size (the budget's own ran in the
    memory plan); on the CPU, with nothing to autotune, none. A warm-up step of several
    prompts runs them all in the spare state slot: no other slot is written."""
    from types import SimpleNamespace

    from kimi_checkpoints import save_tiny_kimi

    save_tiny_kimi(tmp_path, layer_types=["full_attention", "linear_attention"] * 2)
    # 2 heads: a bucket per 32,768 tokens, so a budget of 100,000 spans four buckets
    eng = small_engine(tmp_path, max_num_seqs=4, max_num_batched_tokens=100_000)
    sizes = []
    monkeypatch.setattr(eng.warmup, "forward", sizes.append)
    eng.warmup.linear_norms()
    assert sizes == []
    monkeypatch.setattr(eng.warmup, "device", SimpleNamespace(type="cuda"))
    eng.warmup.profiled = {100_000}  # as after a GPU memory plan: the budget's step ran
    eng.warmup.linear_norms()
    assert sizes == [32768, 65536, 98304]
    sizes.clear()
    eng.warmup.profiled = set()  # num_kv_pages or kv_cache_size_gib given: no plan ran
    eng.warmup.linear_norms()
    assert sizes == [32768, 65536, 98304, 100_000]
    monkeypatch.undo()

    torch.manual_seed(0)
    for states, windows in eng.state_pool.layer_states():
        states.normal_()
        windows.normal_()
    before = [(s.clone(), w.clone()) for s, w in eng.state_pool.layer_states()]
    eng.warmup.forward(100)  # prompts of 63 and 37
    assert eng.warmup.profiled == {100}  # what linear_norms will not run again
    eng.warmup.sampler()  # four one-token prompts, all in the spare slot too
    spare = eng.config.max_num_seqs
    for (states, windows), (s0, w0) in zip(eng.state_pool.layer_states(), before):
        assert torch.equal(states[:spare], s0[:spare])
        assert torch.equal(windows[:spare], w0[:spare])
        assert not torch.equal(states[spare], s0[spare])  # the prompts ran in the spare


def test_the_sampler_step_samples_as_many_rows_as_a_step_holds_at_their_widest(
    tmp_path, monkeypatch
):
    """The memory plan's sampler step: max_num_seqs one-token prompts in one forward,
    every row sampled with top-k, top-p, min-p, penalties and 20 logprobs, so that the
    measured peak holds the sampler's vocabulary-wide tensors for a full batch of rows
    (a prefill step of the budget samples only a few)."""
    from batchgen.runner.sampler import Sampler

    save_tiny_model(tmp_path, "Qwen3ForCausalLM")
    eng = small_engine(tmp_path, max_num_seqs=6)
    calls, forwards = [], []
    sample = Sampler.__call__

    def spy(self, logits, meta):
        calls.append((tuple(logits.shape), meta))
        return sample(self, logits, meta)

    monkeypatch.setattr(Sampler, "__call__", spy)
    hook = eng.model.register_forward_pre_hook(lambda _, args: forwards.append(args[0].shape))
    eng.warmup.sampler()
    hook.remove()
    assert forwards == [torch.Size([6])]
    ((shape, meta),) = calls
    assert shape == (6, eng.hf_config.vocab_size)
    assert not meta.all_greedy and meta.use_top_k and meta.use_top_p and meta.use_min_p
    assert meta.need_logprobs and meta.max_logprobs == 20
    assert meta.output_token_counts is not None and meta.prompt_token_mask is not None
    assert meta.output_token_counts.shape == shape


class FakeGPU:
    """torch.cuda's memory counters, as the plan reads them: a peak that steps raise,
    total memory of which `elsewhere` bytes are held outside this process's allocator;
    `events` records resets."""

    def __init__(self, monkeypatch, total: int, elsewhere: int = 0):
        self.peak, self.events = 0, []
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (total - elsewhere, total))
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: 0)

    def reset(self, device=None):
        self.peak = 0
        self.events.append(("reset", str(device)))

    def step(self, name: str, peak: int):
        self.events.append((name,))
        self.peak = max(self.peak, peak)


GIB = 2**30
LAYOUT = memory.KVLayout(1, 1, 4, 16, torch.float32)


def test_the_plan_reads_the_peak_after_the_sampler_step(monkeypatch):
    """On a GPU the pool gets what is left once both warm-up steps have run: the
    budget's prefill step and the sampler step, whichever peaks higher."""
    gpu = FakeGPU(monkeypatch, 100 * GIB)
    config = EngineConfig(max_num_batched_tokens=64, gpu_memory_utilization=0.5)
    device = torch.device("cuda")
    pages = memory.plan_num_pages(
        config,
        LAYOUT,
        device,
        lambda n: gpu.step(f"forward {n}", 10 * GIB),
        lambda: gpu.step("sampler", 12 * GIB),
    )
    assert gpu.events == [("reset", "cuda"), ("forward 64",), ("sampler",)]
    assert pages == (50 - 12) * GIB // LAYOUT.bytes_per_page
    # without a sampler step only the prefill's peak counts
    assert memory.plan_num_pages(
        config, LAYOUT, device, lambda n: gpu.step(f"forward {n}", 10 * GIB)
    ) == ((50 - 10) * GIB // LAYOUT.bytes_per_page)


class Peers:
    """memory.PlanPeers as TPWorkers would answer: the pages each worker's GPU has left."""

    def __init__(self, gpu: FakeGPU, pages: list[int]):
        self.gpu, self.pages = gpu, pages

    def plan_begin(self):
        self.gpu.events.append(("peers begin",))

    def plan_pages(self):
        self.gpu.events.append(("peers answer",))
        return self.pages


@pytest.mark.parametrize("worker_gib", [20, 60])
def test_tensor_parallel_ranks_plan_the_fewest_pages_any_gpu_holds(monkeypatch, worker_gib):
    """Under tensor parallel every rank holds the same pages: the workers start their
    counts before the warm-up steps they run beside rank 0's, answer after them, and the
    pool gets the fewest pages of any rank."""
    gpu = FakeGPU(monkeypatch, 100 * GIB, elsewhere=10 * GIB)
    worker = worker_gib * GIB // LAYOUT.bytes_per_page
    peers = Peers(gpu, [worker])
    config = EngineConfig(max_num_batched_tokens=64, gpu_memory_utilization=0.9)
    pages = memory.plan_num_pages(
        config,
        LAYOUT,
        torch.device("cuda"),
        lambda n: gpu.step(f"forward {n}", 30 * GIB),
        lambda: gpu.step("sampler", 5 * GIB),
        peers=peers,
    )
    assert gpu.events == [
        ("peers begin",),
        ("reset", "cuda"),
        ("forward 64",),
        ("sampler",),
        ("peers answer",),
    ]
    own = int((90 - 30 - 10) * GIB // LAYOUT.bytes_per_page)  # 50 GiB
    assert pages == min(own, worker)
    # a size given in the config asks nobody
    gpu.events.clear()
    fixed = memory.plan_num_pages(
        EngineConfig(num_kv_pages=7), LAYOUT, torch.device("cuda"), None, peers=peers
    )
    assert fixed == 7 and gpu.events == []


def test_a_tensor_parallel_worker_counts_and_answers_its_own_gpu(monkeypatch):
    """The worker's side of the plan: "begin" resets its own peak, the warm-up steps
    raise it, the query answers the pages of its own layout (its heads) left on its GPU."""
    from batchgen.distributed.messages import PlanBegin, PlanQuery
    from batchgen.engine.tp_worker import _Worker

    gpu = FakeGPU(monkeypatch, 80 * GIB)
    worker = _Worker.__new__(_Worker)  # the plan reads only these three
    worker.config = EngineConfig(gpu_memory_utilization=0.5)
    worker.layout = LAYOUT
    worker.device = torch.device("cuda", 1)
    assert worker.handle(PlanBegin()) is None
    assert gpu.events == [("reset", "cuda:1")]
    gpu.step("forward", 16 * GIB)
    assert worker.handle(PlanQuery()) == (40 - 16) * GIB // LAYOUT.bytes_per_page


def test_a_host_tier_larger_than_the_memory_left_is_refused(tmp_path):
    """MemAvailable, or the cgroup's memory.max less memory.current if smaller, bounds
    the host tier (on every tensor-parallel rank); unreadable files check nothing."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 67108864 kB\nMemAvailable: 33554432 kB\n")  # 32 GiB left
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("max\n")
    check = functools.partial(memory.check_host_budget, meminfo=meminfo, cgroup=cgroup)
    check(30.0)
    check(15.0, ranks=2)
    with pytest.raises(ValueError, match=r"host_kv_size_gib=33 needs 33\.0 GiB .* 32\.0 GiB"):
        check(33.0)
    with pytest.raises(ValueError, match="on each of 4 tensor-parallel ranks"):
        check(10.0, ranks=4)
    (cgroup / "memory.max").write_text(str(20 * 2**30))  # a container's limit, 12 GiB used
    (cgroup / "memory.current").write_text(str(12 * 2**30))
    check(8.0)
    with pytest.raises(ValueError, match="can take 8.0 GiB more"):
        check(9.0)
    memory.check_host_budget(1e6, meminfo=tmp_path / "none", cgroup=tmp_path / "none")
    check(0.0)


def test_the_engine_refuses_an_oversized_host_tier_before_loading_weights(tmp_path, monkeypatch):
    from batchgen.engine import builder_load

    save_tiny_model(tmp_path, "LlamaForCausalLM")
    built = []
    monkeypatch.setattr(builder_load, "build_model", lambda *a, **k: built.append(a))
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable: 1048576 kB\n")  # 1 GiB
    read = memory._mem_available
    monkeypatch.setattr(memory, "_mem_available", lambda _: read(meminfo))
    with pytest.raises(ValueError, match="lower host_kv_size_gib"):
        LLM(model=str(tmp_path), device="cpu", host_kv_size_gib=2.0)
    assert built == []


def test_the_sampling_graphs_reserve_comes_out_of_the_kv_pages(monkeypatch):
    """Bytes the sampling decode graphs hold later, outside every warm-up step's peak,
    come out of the pool's budget; a reserve that grows with max_num_seqs shrinks it."""
    from batchgen.engine.builder_plan import graph_sampling_reserve

    gpu = FakeGPU(monkeypatch, 100 * GIB)
    device = torch.device("cuda")

    def pages(config, reserve):
        forward = lambda n: gpu.step(f"forward {n}", 10 * GIB)  # noqa: E731
        return memory.plan_num_pages(config, LAYOUT, device, forward, None, None, reserve)

    config = EngineConfig(max_num_batched_tokens=64, gpu_memory_utilization=0.5)
    assert pages(config, 3 * GIB) == (50 - 10 - 3) * GIB // LAYOUT.bytes_per_page
    vocab, bf16 = 151936, torch.bfloat16
    small, large = (EngineConfig(max_num_seqs=n, gpu_memory_utilization=0.5) for n in (256, 1024))
    few, many = (graph_sampling_reserve(c, vocab, bf16, True, 1) for c in (small, large))
    assert 0.3 * GIB < few < many  # at 256 rows: the widest tail ~0.24 GB, counts ~0.19 GB
    assert pages(small, few) > pages(large, many)
    # no graphs, or a tensor-parallel group (it samples after the replay): nothing held
    assert graph_sampling_reserve(large, vocab, bf16, False, 1) == 0
    assert graph_sampling_reserve(large, vocab, bf16, True, 2) == 0
