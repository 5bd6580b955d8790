"""DeepSeek-V3 on the Triton attention backend gives the torch backend's results.

CPU fp32, the kernels (mla_rope_store: the rope writing the latent rows into the pages,
mla_decode, prefill_attention) in Triton's interpreter: greedy tokens identical and logprobs within 1e-4 of the torch backend,
through chunked prefill (a small token budget), prefix-cache hits (shared prefixes) and
decode steps mixed with prefill chunks. The interpreter is slow: few prompts, few tokens.
"""

from __future__ import annotations

import random

import pytest
import torch
from eager_graphs import install_eager_graphs
from test_deepseek_v3 import CONFIGS, save_tiny_deepseek

from batchgen import LLM, SamplingParams

RUN = dict(device="cpu", dtype="float32", page_size=4, max_model_len=96, max_num_seqs=4)
MAX_NEW = 5


def _rope_stores_the_latent(monkeypatch):
    """The Triton backend's store_latent refuses to run: the rope launch writes the
    latent rows (layers/mla.py attend_rope), padding rows included."""
    from batchgen.layers import mla_triton

    def no_store(*args):
        raise AssertionError("the latent was stored apart from the rope launch")

    monkeypatch.setattr(mla_triton, "store_latent", no_store)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randint(3, 500) for _ in range(22)]
    return [
        shared + [rng.randint(3, 500) for _ in range(6)],  # longer than the token budget
        [rng.randint(3, 500) for _ in range(3)],
        shared + [rng.randint(3, 500) for _ in range(2)],  # a prefix hit on the first
        [rng.randint(3, 500) for _ in range(9)],
    ]


def _run(path, backend: str, prompts):
    llm = LLM(
        model=str(path),
        attention_backend=backend,
        num_kv_pages=48,
        max_num_batched_tokens=16,
        **RUN,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0, ignore_eos=True)
    outs = [o.outputs[0] for o in llm.generate(prompts[:2], params, use_tqdm=False)]
    # the second wave finds the first's full pages in the prefix cache
    outs += [o.outputs[0] for o in llm.generate(prompts[2:], params, use_tqdm=False)]
    return llm.engine, outs


@pytest.mark.parametrize("name", ["q_lora", "moe_kimi_like"])
def test_triton_backend_matches_torch_backend(tmp_path, monkeypatch, name):
    _rope_stores_the_latent(monkeypatch)
    save_tiny_deepseek(tmp_path, **CONFIGS[name])
    prompts = _prompts()
    _, expected = _run(tmp_path, "torch", prompts)
    engine, got = _run(tmp_path, "triton", prompts)
    assert engine.runner.attention_backend == "triton"
    assert engine.kv.prefix_hit_tokens > 0, "the second wave should hit the prefix cache"
    assert engine.runner.graphs is None  # the CPU runs eagerly
    worst = 0.0
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.token_ids == b.token_ids, f"request {i}"
        for step, tok in enumerate(a.token_ids):
            worst = max(worst, abs(a.logprobs[step][tok].logprob - b.logprobs[step][tok].logprob))
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"


def test_graph_safety_and_split_heads():
    """CUDA graphs need a decode forward without host syncs: the MoE's grouped-GEMM path
    (bfloat16 on Hopper/Blackwell) has none, its reference path (float32, the CPU) reads
    group offsets on the host, so the engine decodes those eagerly. The split plan counts
    MLA's head blocks where the GQA kernel counts KV heads."""
    from types import SimpleNamespace

    from test_deepseek_v3 import tiny_config

    from batchgen.engine.decode_graphs import decode_split_heads, graphs_wanted
    from batchgen.layers import mla
    from batchgen.models.deepseek_v3 import DeepseekV3ForCausalLM

    dense = DeepseekV3ForCausalLM(tiny_config(), 64)
    moe = DeepseekV3ForCausalLM(tiny_config(first_k_dense_replace=1), 64)
    assert dense.graph_safe(torch.float32, "cpu")  # nothing but MLA and dense MLPs
    assert not moe.graph_safe(torch.bfloat16, "cpu")
    assert not moe.graph_safe(torch.float32, "cuda")  # no GPU query needed to say no
    assert mla.decode_split_heads(128, torch.bfloat16, "cuda") == 8  # BLOCK_H 16 on a GPU
    assert moe.decode_split_heads(torch.float32, "cpu") == 1

    config, cuda = SimpleNamespace(enforce_eager=False), torch.device("cuda")
    layout = SimpleNamespace(num_kv_heads=1)
    assert not graphs_wanted(config, moe, torch.float32, cuda, "triton")  # eager fallback
    assert graphs_wanted(config, dense, torch.float32, cuda, "triton")
    assert not graphs_wanted(config, dense, torch.float32, cuda, "torch")
    assert decode_split_heads(moe, layout, torch.float32, cuda) == mla.decode_split_heads(
        4, torch.float32, "cuda"
    )
    # a model that says nothing: the layout's KV heads
    assert decode_split_heads(SimpleNamespace(), layout, torch.float32, cuda) == 1


def test_graph_shaped_decode_matches_torch_backend(tmp_path, monkeypatch):
    """Decode steps through DecodeGraphs' static buffers, as a replay sees them: padded
    buckets (slot -1 rows write no latent, a one-token context), no host-side max length,
    a fixed split count (2: the merge stage runs). Outputs stay the torch backend's."""
    _rope_stores_the_latent(monkeypatch)
    save_tiny_deepseek(tmp_path, **CONFIGS["moe_dense_first"])
    prompts = _prompts()[1:]  # 3 requests: their decode steps replay the bucket of 4
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0, ignore_eos=True)
    kw = dict(model=str(tmp_path), num_kv_pages=48, max_num_batched_tokens=16, **RUN)
    expected = LLM(attention_backend="torch", **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(attention_backend="triton", **kw)
    replays = install_eager_graphs(llm, RUN)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert 4 in replays, replays  # a padded bucket
    worst = 0.0
    for i, (a, b) in enumerate((x.outputs[0], y.outputs[0]) for x, y in zip(got, expected)):
        assert a.token_ids == b.token_ids, f"request {i}"
        for step, tok in enumerate(a.token_ids):
            worst = max(worst, abs(a.logprobs[step][tok].logprob - b.logprobs[step][tok].logprob))
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"
