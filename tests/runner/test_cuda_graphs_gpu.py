"""Decode CUDA graphs must give exactly what eager steps give (same kernels, same
inputs), at every bucket size, and stay correct with the host tier swapping pages."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import save_tiny_model
from parity import collapsed, completions

from batchgen import LLM, SamplingParams

pytestmark = pytest.mark.gpu

KW = dict(
    device="cuda",
    dtype="bfloat16",
    attention_backend="triton",
    page_size=16,
    max_model_len=512,
    max_num_seqs=48,
)


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randint(3, 500) for _ in range(rng.randint(5, 200))] for _ in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-graphs")
    save_tiny_model(path, "Qwen3ForCausalLM")
    return str(path)


@pytest.mark.parametrize("n", [1, 8, 48])
def test_graph_replay_matches_eager(model_dir, n):
    """Batch sizes that are buckets: the same kernels see the same shapes, so eager steps
    and replays must agree bit for bit."""
    prompts = _prompts(n)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eager = LLM(model=model_dir, enforce_eager=True, num_kv_pages=2048, **KW)
    graphs = LLM(model=model_dir, num_kv_pages=2048, **KW)
    assert eager.engine.runner.graphs is None and graphs.engine.runner.graphs is not None
    a = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    assert graphs.engine.runner.graphs.graphs, "decode steps should have replayed graphs"
    assert a == b


def test_graphs_with_swaps_and_reconfigure(model_dir):
    """No row may depart from the ample pool's beyond the logprob-closeness rule, endings
    included (ignore_eos: every row ends by length). In bf16 the batch composition (and
    so GEMM shapes and prefix reuse) differs between the runs, so near-ties may flip;
    nothing else may differ."""
    prompts = _prompts(40, seed=2)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=5)
    ref = completions(LLM(model=model_dir, num_kv_pages=4096, **KW), prompts, params)
    tight = LLM(model=model_dir, num_kv_pages=80, host_kv_size_gib=0.5, batchgen_debug=True, **KW)
    rows = completions(tight, prompts, params)
    m = tight.engine.metrics()
    assert m["swaps_out"] > 0 and m["recomputes"] == 0
    assert collapsed(rows, ref) == 0
    graphs = tight.engine.runner.graphs
    stream = graphs.capture_stream
    assert stream is not None
    tight.engine.reconfigure(120)
    assert collapsed(completions(tight, prompts, params), ref) == 0
    assert graphs.graphs, "the decode graphs should have been captured again"
    assert graphs.capture_stream is stream  # no further stream: it would slow every replay


def test_reconfigure_frees_the_old_pool_after_sampled_steps(model_dir, monkeypatch):
    """The default path (seeded sampled rows, EOS endings: the sampling tail captured in
    the decode graphs) then reconfigure(): the old pool's memory is given back before the
    new pool is allocated, so a pool of most of the GPU can be re-created (on an H100 the
    invariance probe ran out of memory re-creating a 69 GiB pool beside the old one)."""
    from batchgen.engine import memory

    llm = LLM(model=model_dir, num_kv_pages=4096, **KW)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=32) for i in range(8)]
    llm.generate(_prompts(8, seed=3), params, use_tqdm=False)
    graphs = llm.engine.runner.graphs
    assert graphs.tail_graphs, "the sampled steps should have replayed a sampling tail"
    pool_bytes = llm.engine.pool.kv.numel() * llm.engine.pool.kv.element_size()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    allocated_then = []
    real = memory.PagePool

    def watching(*args, **kw):
        allocated_then.append(torch.cuda.memory_allocated())
        return real(*args, **kw)

    monkeypatch.setattr(memory, "PagePool", watching)
    llm.engine.reconfigure(4096)
    assert len(allocated_then) == 1
    assert allocated_then[0] <= before - pool_bytes, (
        f"{(allocated_then[0] - (before - pool_bytes)) / 2**20:.0f} MiB of the old pool "
        "still allocated when the new one was made"
    )
    outs = llm.generate(_prompts(8, seed=3), params, use_tqdm=False)
    assert all(o.outputs[0].token_ids for o in outs)
