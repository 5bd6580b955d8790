"""Stop strings, n > 1 and prompt logprobs on the GPU in bf16, the way users run them: the
default model (SmolLM2-135M-Instruct) on chat prompts, decode CUDA graphs, pipelined
decode, EOS and stop-string endings, no logprobs unless the test is about them, debug
off. Their float32 GPU tests (tests/engine/test_stop_strings.py,
tests/api/test_parallel_sampling.py, tests/api/test_prompt_logprobs.py) compare token for
token; here each is judged as bf16 allows: the logprob-closeness rule against the same
engine asked for five logprobs, and prompt logprobs against transformers' float32 model
within twice the error of transformers' own bf16 model."""

from __future__ import annotations

import pytest
import torch
from gpu_defaults import GPU, PathSeen, collapsed_rows
from parity import completions
from prompts import QUESTIONS

from batchgen import LLM, SamplingParams

pytestmark = pytest.mark.gpu

KW = dict(max_model_len=1024)
STOP = "\n"


@pytest.fixture(scope="module")
def llm():
    return LLM(**GPU, **KW)


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    """The questions through the chat template, as token ids."""
    return [
        llm.tokenizer.encode(
            llm.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False
        )
        for q in QUESTIONS
    ]


def test_stop_strings_stay_close_to_the_logprobs_run(llm, prompts):
    """Every other request stops at a newline; the rest end on EOS or their length. No
    row collapses against the same requests asked for five logprobs (steps not
    pipelined), endings included; a row ended by the stop string names it, its text
    stops before it, and with include_stop_str_in_output the text ends with it."""
    seen = PathSeen(llm)
    params = [
        SamplingParams(temperature=0, max_tokens=96, stop=[STOP] if i % 2 else None)
        for i in range(len(prompts))
    ]
    outs = completions(llm, prompts, params)
    seen.check()
    by_string = [i for i, c in enumerate(outs) if c.stop_reason == STOP]
    by_eos = [i for i, c in enumerate(outs) if c.finish_reason == "stop" and c.stop_reason is None]
    print(f"{len(by_string)} rows ended by the stop string, {len(by_eos)} by EOS")
    assert by_string and by_eos
    for i in by_string:
        assert outs[i].finish_reason == "stop" and STOP not in outs[i].text, outs[i]
    judge = [  # off-defaults: the judge
        SamplingParams(temperature=0, max_tokens=96, stop=p.stop, logprobs=5) for p in params
    ]
    ref = completions(llm, prompts, judge)
    bad = collapsed_rows(llm, prompts, outs, ref, llm.engine.eos_token_ids)
    assert not bad, f"rows {bad} collapsed"
    kept = [
        SamplingParams(temperature=0, max_tokens=96, stop=[STOP], include_stop_str_in_output=True)
        for _ in by_string
    ]
    for i, k in zip(by_string, completions(llm, [prompts[i] for i in by_string], kept)):
        if k.token_ids == outs[i].token_ids:  # the same near-ties taken
            assert k.text == outs[i].text + STOP, (outs[i], k)


def test_n_samples(llm, prompts):
    """Greedy n=3: every sample stays close to the n=1 run with logprobs. Seeded n=4
    sampled: four different completions, the prompt's full pages computed once."""
    few = prompts[:6]
    seen = PathSeen(llm)
    many = llm.generate(few, SamplingParams(n=3, temperature=0, max_tokens=48), use_tqdm=False)
    seen.check()
    judge = completions(llm, few, SamplingParams(temperature=0, max_tokens=48, logprobs=5))
    flat = [(p, c, r) for p, o, r in zip(few, many, judge) for c in o.outputs]
    assert len(flat) == 3 * len(few)
    rows = [c for _, c, _ in flat]
    bad = collapsed_rows(
        llm, [p for p, _, _ in flat], rows, [r for _, _, r in flat], llm.engine.eos_token_ids
    )
    assert not bad, f"samples {bad} collapsed"

    prompt = few[0] + few[1][-7:]
    before = llm.engine.metrics()
    (out,) = llm.generate(
        [prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=32), use_tqdm=False
    )
    after = llm.engine.metrics()
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    # the first sample computes what the cache lacks (the chat template's head is
    # cached); the others hit its full pages and compute the last page only
    page = llm.engine.config.page_size
    tail = len(prompt) - page * ((len(prompt) - 1) // page)
    computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    hits = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    assert computed <= len(prompt) + 3 * tail and hits >= 3 * (len(prompt) - tail), (
        computed,
        hits,
        len(prompt),
    )


@pytest.fixture(scope="module")
def transformers_models():
    """transformers' default model in float32 and in bf16, on the GPU."""
    from transformers import AutoModelForCausalLM

    from batchgen.models.default_model import default_model_path

    path = default_model_path()
    load = AutoModelForCausalLM.from_pretrained
    return [
        load(str(path.parent), gguf_file=path.name, dtype=dtype).to(GPU["device"]).eval()
        for dtype in (torch.float32, torch.bfloat16)
    ]


def _prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.tensor([prompt], device=GPU["device"])
        return torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1).cpu()


def test_prompt_logprobs(llm, prompts, transformers_models):
    """Each prompt token's logprob and the top three's, against transformers' float32
    model: within twice the largest error of transformers' bf16 model on the same
    entries, plus 0.02; a prompt the prefix cache holds is computed again."""
    f32, bf16 = transformers_models
    few = prompts[:8]
    completions(llm, few[:2], SamplingParams(temperature=0, max_tokens=4))  # cache two
    before = llm.engine.metrics()
    outs = llm.generate(few, SamplingParams(max_tokens=8, prompt_logprobs=3), use_tqdm=False)
    after = llm.engine.metrics()
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] == sum(
        map(len, few)
    )
    ours_err = theirs_err = 0.0
    for prompt, out in zip(few, outs):
        ref, half = _prompt_logprobs(f32, prompt), _prompt_logprobs(bf16, prompt)
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for p, token in enumerate(prompt[1:], start=1):
            assert token in got[p] and len(got[p]) in (3, 4)
            for tid, lp in got[p].items():  # the prompt token and the top three
                ours_err = max(ours_err, abs(lp.logprob - float(ref[p - 1, tid])))
                theirs_err = max(theirs_err, abs(float(half[p - 1, tid] - ref[p - 1, tid])))
    print(f"largest prompt logprob error: ours {ours_err:.3f}, transformers bf16 {theirs_err:.3f}")
    assert ours_err <= 2 * theirs_err + 0.02
