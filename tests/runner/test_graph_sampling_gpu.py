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
