"""Stop strings in the default configuration (pipelined decode, EOS on): one completed by
the last token the length limit allows still ends the request as a stop, and none ends
it before min_tokens output tokens, as in vLLM."""

from __future__ import annotations

import random

import pytest
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams

# a fixed pool (one request at a time): on the GPU a planned pool takes 90% of the free
# memory, which the previous test's engine may still hold
KW = dict(device="cpu", dtype="float32", page_size=4, max_model_len=96, num_kv_pages=64)
MAX = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("stops")
    save_tiny_model(path, "LlamaForCausalLM")
    return path


@pytest.fixture(scope="module", autouse=True)
def on_device(engine_device):
    """Every test on the CPU and on the GPU (module-level KW, reset afterwards)."""
    KW["device"] = engine_device
    yield engine_device
    KW["device"] = "cpu"


@pytest.fixture(scope="module")
def free_runs(model_dir, on_device):
    """Greedy outputs with no stop string: (prompt, token ids, text, finish reason)."""
    rng = random.Random(7)
    prompts = [[rng.randint(3, 500) for _ in range(rng.randint(2, 20))] for _ in range(24)]
    llm = LLM(model=str(model_dir), **KW)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX), use_tqdm=False)
    return [
        (p, o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
        for p, o in zip(prompts, outs)
    ]


def _unique_word_at(ids: list[int], index: int) -> str | None:
    """The word of ids[index] if no other word of the output contains it."""
    word = f"w{ids[index]}"
    if sum(word in f"w{t}" for t in ids) == 1:
        return word
    return None


def _pick(free_runs, index: int):
    """A length-ended run whose token at `index` is a word found nowhere else in it."""
    for prompt, ids, text, reason in free_runs:
        if reason == "length" and len(ids) == MAX and _unique_word_at(ids, index):
            return prompt, ids, text, _unique_word_at(ids, index)
    raise AssertionError(f"no free run has a unique word at {index}")


def _generate(model_dir, prompt, params, pipeline: bool, **kw):
    llm = LLM(model=str(model_dir), pipeline_decode=pipeline, **{**KW, **kw})
    queued = []
    launch = llm.engine.runner.launch_decode

    def counted(sched, prev=None, *copies):
        queued.append(prev is not None)
        return launch(sched, prev, *copies)

    llm.engine.runner.launch_decode = counted
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert any(queued) == pipeline
    assert (llm.engine.runner.graphs is not None) == (KW["device"] == "cuda")
    return out


@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("include", [False, True])
def test_stop_on_the_last_allowed_token_wins_over_max_tokens(
    model_dir, free_runs, pipeline, include
):
    prompt, ids, text, stop = _pick(free_runs, MAX - 1)
    params = SamplingParams(
        temperature=0, max_tokens=MAX, stop=[stop], include_stop_str_in_output=include
    )
    out = _generate(model_dir, prompt, params, pipeline)
    at = text.index(stop)
    assert out.token_ids == ids
    assert out.text == (text[: at + len(stop)] if include else text[:at])
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


@pytest.mark.parametrize("pipeline", [True, False])
def test_stop_on_the_last_allowed_token_wins_over_max_model_len(model_dir, free_runs, pipeline):
    prompt, ids, text, stop = _pick(free_runs, MAX - 1)
    params = SamplingParams(temperature=0, max_tokens=None, stop=[stop])
    out = _generate(model_dir, prompt, params, pipeline, max_model_len=len(prompt) + MAX)
    assert out.token_ids == ids
    assert out.text == text[: text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


@pytest.mark.parametrize("pipeline", [True, False])
def test_no_stop_string_before_min_tokens(model_dir, free_runs, pipeline):
    """A stop string completed by output token j (1-based) ends the request only when
    j > min_tokens, as EOS and stop ids do (their first allowed place is min_tokens+1)."""
    j = 4
    prompt, ids, text, stop = _pick(free_runs, j - 1)
    held = SamplingParams(temperature=0, max_tokens=MAX, min_tokens=j, stop=[stop])
    out = _generate(model_dir, prompt, held, pipeline)
    assert out.token_ids == ids and out.text == text  # the only match is held back
    assert out.finish_reason == "length" and out.stop_reason is None
    allowed = SamplingParams(temperature=0, max_tokens=MAX, min_tokens=j - 1, stop=[stop])
    out = _generate(model_dir, prompt, allowed, pipeline)
    assert out.token_ids == ids[:j] and out.text == text[: text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_min_tokens_text_is_not_searched_later(model_dir, free_runs):
    """A stop string inside the first min_tokens tokens' text is not found once the
    output grows past min_tokens."""
    prompt, ids, text, stop = _pick(free_runs, 1)
    params = SamplingParams(temperature=0, max_tokens=MAX, min_tokens=5, stop=[stop])
    out = _generate(model_dir, prompt, params, True)
    assert out.token_ids == ids and out.finish_reason == "length"
