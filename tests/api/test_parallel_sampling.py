"""SamplingParams(n > 1) and best_of: one prompt, n completions, the prompt computed
once (its full pages shared through the prefix cache, each further sample recomputing
only the last partial page)."""

from __future__ import annotations

import pytest
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams

PAGE = 4
KW = dict(device="cpu", dtype="float32", page_size=PAGE, max_model_len=96, num_kv_pages=128)
PROMPT = list(range(10, 32))  # 22 tokens: 5 full pages and a tail of 2


@pytest.fixture(scope="module")
def llm(tmp_path_factory, engine_device):
    """On the CPU and on the GPU: the counted prompt work is the same on both."""
    path = tmp_path_factory.mktemp("n-samples")
    save_tiny_model(path, "LlamaForCausalLM")
    return LLM(model=str(path), **dict(KW, device=engine_device))


def _generate(llm, prompts, params):
    out = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert not engine.has_unfinished and not engine.requests
    assert engine.kv.num_free_pages == engine.kv.allocator.num_pages
    return out


def _tokens(out):
    return [c.token_ids for c in out.outputs]


@pytest.mark.parametrize("prompt_len", [22, 24, 3])
def test_prompt_is_computed_once(llm, prompt_len):
    prompt = [400 + prompt_len] + list(range(40, 39 + prompt_len))  # cached by no other case
    n = 4
    before = llm.engine.metrics()
    (out,) = _generate(llm, [prompt], SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=5))
    after = llm.engine.metrics()
    assert [c.index for c in out.outputs] == list(range(n))
    assert all(len(c.token_ids) == 5 for c in out.outputs)
    # the first sample computes the prompt; the others hit its full pages and compute
    # only the last page (the whole prompt when it has no full page before its last token)
    tail = prompt_len - PAGE * ((prompt_len - 1) // PAGE)
    computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    assert computed == prompt_len + (n - 1) * tail
    hits = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    assert hits == (n - 1) * (prompt_len - tail)


def test_greedy_samples_are_identical(llm):
    (one,) = _generate(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=8))
    (many,) = _generate(llm, [PROMPT], SamplingParams(n=3, temperature=0, max_tokens=8))
    assert _tokens(many) == _tokens(one) * 3


def test_seeded_samples_reproduce_and_differ(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12)
    first = _tokens(_generate(llm, [PROMPT], params)[0])
    second = _tokens(_generate(llm, [PROMPT, [5, 6, 7]], params)[0])
    assert first == second
    assert len({tuple(t) for t in first}) == 4  # each sample has its own seed
    (alone,) = _generate(llm, [PROMPT], SamplingParams(temperature=1.0, seed=11, max_tokens=12))
    assert first[0] == alone.outputs[0].token_ids  # sample i is drawn with seed + i


def test_best_of_returns_the_best_by_cumulative_logprob(llm):
    all4 = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=6, logprobs=0)
    (every,) = _generate(llm, [PROMPT], all4)
    ranked = sorted(every.outputs, key=lambda c: -c.cumulative_logprob)
    (best,) = _generate(
        llm, [PROMPT], SamplingParams(n=2, best_of=4, temperature=1.0, seed=5, max_tokens=6)
    )
    assert [c.index for c in best.outputs] == [0, 1]
    assert _tokens(best) == [c.token_ids for c in ranked[:2]]
    # the ranking's cumulative logprobs are reported; its per-token logprobs are not
    assert all(c.logprobs is None for c in best.outputs)
    best_cums = [c.cumulative_logprob for c in best.outputs]
    assert best_cums == pytest.approx([c.cumulative_logprob for c in ranked[:2]], abs=1e-5)
    (logged,) = _generate(
        llm,
        [PROMPT],
        SamplingParams(n=2, best_of=4, temperature=1.0, seed=5, max_tokens=6, logprobs=1),
    )
    assert _tokens(logged) == _tokens(best)
    cums = [c.cumulative_logprob for c in logged.outputs]
    assert cums == sorted(cums, reverse=True)
    assert cums == pytest.approx([c.cumulative_logprob for c in ranked[:2]], abs=1e-5)


def test_outputs_keep_prompt_order_with_mixed_n(llm):
    params = [
        SamplingParams(n=2, temperature=0, max_tokens=4),
        SamplingParams(temperature=0, max_tokens=4),
        SamplingParams(n=3, temperature=0, max_tokens=4),
    ]
    prompts = [PROMPT, [7, 8, 9], [100, 101, 102, 103, 104]]
    outs = _generate(llm, prompts, params)
    assert [len(o.outputs) for o in outs] == [2, 1, 3]
    assert [o.prompt_token_ids for o in outs] == prompts
    singles = [_generate(llm, [p], SamplingParams(temperature=0, max_tokens=4))[0] for p in prompts]
    for o, s in zip(outs, singles):
        assert all(c.token_ids == s.outputs[0].token_ids for c in o.outputs)


@pytest.mark.parametrize("kw", [dict(n=2, best_of=1), dict(best_of=0)])
def test_bad_n_or_best_of(kw):
    field = "best_of" if "best_of" in kw else "n"
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**kw)


def test_engine_refuses_n_above_one(llm):
    with pytest.raises(ValueError, match="one sample per request"):
        llm.engine.add_request("x", [5, 6], SamplingParams(n=2))
