"""Sampling captured in the decode CUDA graph (runner/graph_sampling.py) must draw what
the eager sampler draws: same seeds, same tokens, at bucket sizes (where an eager step's
GEMMs see the replay's shapes), greedy rows mixed in, penalties on kept counts."""

from __future__ import annotations

import random

import pytest
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams

pytestmark = pytest.mark.gpu

KW = dict(
    device="cuda",
    dtype="bfloat16",
    attention_backend="triton",
    page_size=16,
    max_model_len=512,
    max_num_seqs=48,
    num_kv_pages=2048,
)
CONFIGS = {
    "top_p": dict(temperature=0.8, top_p=0.95),
    "top_k": dict(temperature=0.8, top_p=0.95, top_k=50),
    "min_p": dict(temperature=1.0, min_p=0.05),
    "penalty": dict(temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1),
    "frequency": dict(temperature=0.9, frequency_penalty=0.4, presence_penalty=0.2),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-graph-sampling")
    save_tiny_model(path, "Qwen3ForCausalLM")
    return str(path)


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randint(3, 500) for _ in range(rng.randint(5, 100))] for _ in range(n)]


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("n", [8, 48])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_graph_sampled_tokens_equal_eager(model_dir, n, name):
    prompts = _prompts(n)
    # every third row greedy: greedy and sampled rows in one captured draw
    params = [
        SamplingParams(max_tokens=32, ignore_eos=True, seed=i, **CONFIGS[name])
        if i % 3
        else SamplingParams(max_tokens=32, ignore_eos=True, temperature=0)
        for i in range(n)
    ]
    eager = LLM(model=model_dir, enforce_eager=True, **KW)
    graphs = LLM(model=model_dir, **KW)
    a, b = _tokens(eager, prompts, params), _tokens(graphs, prompts, params)
    decode = graphs.engine.runner.graphs
    assert decode.tail_graphs, "decode steps should have sampled inside the graphs"
    assert a == b


def test_logprobs_steps_sample_eagerly_beside_graph_steps(model_dir):
    """A batch asking for logprobs takes the eager sampler after the replay; the same
    requests without logprobs sample inside the graph: the same tokens both ways."""
    prompts = _prompts(8, seed=1)
    base = dict(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9)
    graphs, eager_lp = LLM(model=model_dir, **KW), LLM(model=model_dir, **KW)
    plain = _tokens(graphs, prompts, [SamplingParams(seed=i, **base) for i in range(8)])
    assert graphs.engine.runner.graphs.tail_graphs
    lp = [SamplingParams(seed=i, logprobs=1, **base) for i in range(8)]
    assert _tokens(eager_lp, prompts, lp) == plain
    assert not eager_lp.engine.runner.graphs.tail_graphs


def test_a_tail_with_no_room_samples_eagerly_instead_of_running_out(tmp_path, caplog):
    """A device filled so that the penalised sampling graphs (a 151,936-token vocabulary
    at 256 rows: ~0.24 GB of pool and ~0.19 GB of counts) cannot be held: the sampled
    steps replay the forward graph and sample after it (one warning), no out-of-memory
    error, and the tokens are an eager engine's."""
    import gc
    import logging

    import torch

    from batchgen.runner.graph_sampling import Variant, counts_bytes, tail_bytes

    vocab = 151936
    save_tiny_model(tmp_path, "Qwen3ForCausalLM", vocab_size=vocab)
    kw = dict(KW, max_num_seqs=256, num_kv_pages=512)
    prompts = _prompts(16, seed=2)
    pen = dict(max_tokens=16, ignore_eos=True, temperature=0.8, repetition_penalty=1.1)
    params = [SamplingParams(seed=i, **pen) for i in range(16)]
    eager = LLM(model=str(tmp_path), enforce_eager=True, **kw)
    want = _tokens(eager, prompts, params)
    del eager
    gc.collect()
    llm = LLM(model=str(tmp_path), **kw)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    _tokens(llm, prompts, greedy)  # the forward graphs are captured
    graphs = llm.engine.runner.graphs
    assert graphs.graphs and not graphs.tail_graphs
    need = tail_bytes(256, vocab, graphs.dtype, Variant(False, 0, True)) + counts_bytes(256, vocab)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    blocker = torch.empty(free - need // 2, dtype=torch.uint8, device="cuda")
    try:  # a failure's traceback must not keep the device full for the next tests
        with caplog.at_level(logging.WARNING, logger="batchgen.runner.graph_sampling"):
            got = _tokens(llm, prompts, params)
    finally:
        del blocker
    assert got == want
    assert not graphs.tail_graphs and Variant(False, 0, True) in graphs.refused_tails
    assert len([r for r in caplog.records if "do not fit" in r.message]) == 1


def test_a_warm_up_out_of_memory_captures_nothing_and_samples_eagerly(model_dir, monkeypatch):
    """A tail whose eager warm-up runs out of memory leaves no graph of it: the steps
    sample after the forward's replay, the same tokens; after the pool is re-created it
    is tried again and captured."""
    import torch

    prompts = _prompts(8, seed=3)
    base = dict(max_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.9)
    params = [SamplingParams(seed=i, **base) for i in range(8)]
    want = _tokens(LLM(model=model_dir, enforce_eager=True, **KW), prompts, params)
    llm = LLM(model=model_dir, **KW)
    graphs = llm.engine.runner.graphs

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("no memory (test)")

    monkeypatch.setattr(graphs, "_forward_tail", out_of_memory)
    assert _tokens(llm, prompts, params) == want
    assert graphs.graphs and not graphs.tail_graphs and graphs.refused_tails
    monkeypatch.undo()
    graphs.clear()
    assert _tokens(llm, prompts, params) == want
    assert graphs.tail_graphs and not graphs.refused_tails
