"""SamplingParams.prompt_logprobs against transformers on the same weights: per prompt
position (None first) the prompt token's logprob and rank and the top-k, with the whole
prompt computed even when the prefix cache holds it, and across prefill chunks."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams

KW = dict(device="cpu", dtype="float32", page_size=4, max_model_len=96, num_kv_pages=128)
PROMPT = [1] + list(range(30, 51))  # 22 tokens
K = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompt-logprobs")
    model = save_tiny_model(path, "LlamaForCausalLM")
    return path, model


@pytest.fixture(scope="module")
def llm(checkpoint, engine_device):
    """On the CPU and on the GPU (float32, Triton attention): the same reference."""
    return LLM(model=str(checkpoint[0]), **dict(KW, device=engine_device))


def _reference(model, prompt: list[int]) -> torch.Tensor:
    """[P - 1, V]: row p is transformers' logprobs of the token after position p."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def _check(out, model, prompt: list[int], k: int) -> None:
    ref = _reference(model, prompt)
    got = out.prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    for p, token in enumerate(prompt[1:], start=1):
        row = ref[p - 1]
        entry = got[p]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(k)
        assert set(entry) == set(top.indices.tolist()) | {token}
        for rank, (tid, val) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            if tid != token:
                assert entry[tid].rank == rank
            assert entry[tid].logprob == pytest.approx(val, abs=1e-4)


def test_prompt_logprobs_match_transformers(llm, checkpoint):
    asks = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=K)
    plain = SamplingParams(temperature=0, max_tokens=3)
    prompts = [[1, 9, 10, 11, 12], PROMPT, [1, 7, 8]]  # one step; rows packed end to end
    out = llm.generate(prompts, [plain, asks, asks], use_tqdm=False)
    assert out[0].prompt_logprobs is None
    _check(out[1], checkpoint[1], PROMPT, K)
    _check(out[2], checkpoint[1], [1, 7, 8], K)
    assert (
        llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)[0].prompt_logprobs
        is None
    )


def test_prompt_logprobs_zero_gives_the_prompt_token_only(llm, checkpoint):
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=2, prompt_logprobs=0), use_tqdm=False)
    assert all(list(e) == [t] for e, t in zip(out.prompt_logprobs[1:], PROMPT[1:]))
    _check(out, checkpoint[1], PROMPT, 0)


def test_a_cached_prompt_is_computed_again(llm, checkpoint):
    prompt = [1] + list(range(60, 80))
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    before = llm.engine.metrics()
    (out,) = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False
    )
    after = llm.engine.metrics()
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] == len(prompt)
    assert after["prefix_hit_tokens"] == before["prefix_hit_tokens"]
    _check(out, checkpoint[1], prompt, 2)


def test_chunked_prefill(checkpoint):
    llm = LLM(model=str(checkpoint[0]), max_num_batched_tokens=8, **KW)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=K)
    prompts = [PROMPT, [1] + list(range(100, 119))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, prompt in zip(outs, prompts):
        _check(out, checkpoint[1], prompt, K)


def test_with_n_samples_the_prompt_is_still_shared(llm, checkpoint):
    prompt = [1] + list(range(200, 221))  # 22 tokens: the others recompute a tail of 2
    before = llm.engine.metrics()
    (out,) = llm.generate(
        [prompt],
        SamplingParams(n=3, temperature=0, max_tokens=2, prompt_logprobs=1),
        use_tqdm=False,
    )
    after = llm.engine.metrics()
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] == 22 + 2 * 2
    _check(out, checkpoint[1], prompt, 1)


def test_bad_prompt_logprobs():
    with pytest.raises(ValueError, match=r"SamplingParams\.prompt_logprobs\b"):
        SamplingParams(prompt_logprobs=21)
