"""Expert parallel (enable_expert_parallel=True) at tensor_parallel_size=2 (this process
rank 0, one spawned gloo worker) and 4 against one process, on tiny random DeepSeek-V3
and Kimi Linear checkpoints in float32 on the CPU: each rank holds its block of the
routed experts and the replicated shared experts, runs a slice of the step's tokens,
sends each token to its experts' ranks and back by all-to-all, and the slices are
gathered. Greedy tokens and finish reasons equal to one process's in the default
configuration (no logprobs, so decode steps are queued ahead; each checkpoint's EOS a
token its runs emit mid-way), with an ample pool and with a pool too small whose pages
swap to the host tier; logprobs within 1e-4 where a run asks for them."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
from conftest import record_launches, save_tiny_model
from deepseek_checkpoints import CONFIGS, save_tiny_deepseek
from int4_blocks import KIMI_K2_THINKING_IGNORE, write_pack_quantized
from kimi_checkpoints import save_tiny_kimi
from penalty_reference import set_eos

from batchgen import LLM, SamplingParams
from batchgen.config import EngineConfig

KW = dict(device="cpu", dtype="float32", page_size=4, max_num_batched_tokens=32, max_num_seqs=8)
PARAMS = SamplingParams(temperature=0, max_tokens=16)
LOGPROBS = SamplingParams(temperature=0, max_tokens=16, logprobs=1)  # off-defaults: compared
EP = dict(enable_expert_parallel=True)


def _prompts(seed: int, head: int, tails: tuple[int, int], n: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randint(3, 500) for _ in range(head)]
    return [shared + [rng.randint(3, 500) for _ in range(rng.randint(*tails))] for _ in range(n)]


def _rows(outs) -> list[tuple[list[int], str]]:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def _logprobs(outs) -> list[list[float]]:
    return [
        [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
        for o in outs
    ]


def _reference(path: Path, prompts, **kw) -> tuple[list, list, list]:
    """One process, an ample pool, the tier off, after setting the checkpoint's EOS to a
    token the first run emits mid-way in the most rows: its rows, and its rows and
    logprobs when every request asks for logprobs."""
    kw = dict(num_kv_pages=400, **KW, **kw)
    free = _rows(LLM(str(path), **kw).generate(prompts, PARAMS, use_tqdm=False))
    counts = Counter(t for tokens, _ in free for t in set(tokens[2:-2]) if t > 2)
    set_eos(path, counts.most_common(1)[0][0])
    llm = LLM(str(path), **kw)
    want = _rows(llm.generate(prompts, PARAMS, use_tqdm=False))
    assert {r for _, r in want} == {"stop", "length"}, want
    outs = llm.generate(prompts, LOGPROBS, use_tqdm=False)
    return want, _rows(outs), _logprobs(outs)


def _expert_parallel(path: Path, prompts, size: int = 2, **kw) -> dict:
    """A run of the default params (and one asking for logprobs, with `logprobs`) with
    experts spread over `size` ranks: rows, metrics, whether decode steps were queued
    ahead, rank 0's model."""
    llm = LLM(str(path), tensor_parallel_size=size, **EP, **KW, **kw)
    try:
        launches = record_launches(llm.engine.runner)
        rows = _rows(llm.generate(prompts, PARAMS, use_tqdm=False))
        behind = [b for _, b in launches]
        outs = llm.generate(prompts, LOGPROBS, use_tqdm=False)
        return dict(
            rows=rows,
            metrics=llm.engine.metrics(),
            behind=behind,
            model=llm.engine.model,
            logprob_rows=_rows(outs),
            logprobs=_logprobs(outs),
        )
    finally:
        llm.engine.shutdown()


def _assert_logprobs_close(got: list, want: list) -> None:
    worst = max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x, y))
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"


def _assert_expert_parallel(model, size: int, num_experts: int, shared_inter: int) -> None:
    moes = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts")]
    assert moes
    for moe in moes:
        assert moe.ep is not None and moe.ep.size == size and moe.tp is None
        assert moe.experts.local_experts == range(0, num_experts // size)
        # the shared experts are replicated: their whole intermediate width on every rank
        assert moe.shared_experts.down_proj.weight.shape[1] == shared_inter


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-deepseek")
    save_tiny_deepseek(path, **CONFIGS["moe_dense_first"], n_shared_experts=1)
    prompts = _prompts(seed=1, head=8, tails=(1, 12))
    return path, prompts, _reference(path, prompts, max_model_len=64)


@pytest.mark.slow
def test_deepseek_ep2_in_the_default_configuration_equals_one_process(deepseek):
    path, prompts, (want, want_lp_rows, want_lp) = deepseek
    got = _expert_parallel(path, prompts, num_kv_pages=200, max_model_len=64)
    assert got["rows"] == want
    assert any(got["behind"]), "no decode step was queued ahead"
    assert got["logprob_rows"] == want_lp_rows
    _assert_logprobs_close(got["logprobs"], want_lp)
    _assert_expert_parallel(got["model"], 2, num_experts=8, shared_inter=32)


@pytest.mark.slow
def test_deepseek_ep2_with_host_tier_swaps_equals_one_process(deepseek):
    path, prompts, (want, want_lp_rows, want_lp) = deepseek
    tier = dict(num_kv_pages=18, host_kv_size_gib=0.001, max_model_len=64)
    got = _expert_parallel(path, prompts, **tier)
    assert got["rows"] == want
    assert got["metrics"]["swaps_in"] > 0 and got["metrics"]["recomputes"] == 0, got["metrics"]
    assert any(got["behind"]), "no decode step was queued ahead"
    assert got["logprob_rows"] == want_lp_rows
    _assert_logprobs_close(got["logprobs"], want_lp)


@pytest.mark.slow
def test_deepseek_ep4_equals_one_process(deepseek):
    path, prompts, (want, want_lp_rows, want_lp) = deepseek
    got = _expert_parallel(path, prompts, size=4, num_kv_pages=200, max_model_len=64)
    assert got["rows"] == want
    assert got["logprob_rows"] == want_lp_rows
    _assert_logprobs_close(got["logprobs"], want_lp)
    _assert_expert_parallel(got["model"], 4, num_experts=8, shared_inter=32)


@pytest.mark.slow
def test_kimi_linear_ep2_default_configuration_and_state_swaps_equal_one_process(tmp_path):
    """Kimi Linear (3 KDA : 1 MLA, MoE after a dense layer): KDA and MLA heads split, the
    experts spread; an ample pool, then a pool too small that swaps pages and state
    slots."""
    pytest.importorskip("transformers.models.kimi_linear")
    L, F = "linear_attention", "full_attention"
    save_tiny_kimi(tmp_path, layer_types=[L, L, L, F], first_k_dense_replace=1)
    prompts = _prompts(seed=2, head=18, tails=(1, 40))
    want, want_lp_rows, want_lp = _reference(tmp_path, prompts, max_model_len=128)
    got = _expert_parallel(tmp_path, prompts, num_kv_pages=400, max_model_len=128)
    assert got["rows"] == want
    assert any(got["behind"]), "no decode step was queued ahead"
    assert got["logprob_rows"] == want_lp_rows
    _assert_logprobs_close(got["logprobs"], want_lp)
    moe = next(layer.mlp for layer in got["model"].layers if hasattr(layer.mlp, "experts"))
    assert moe.ep is not None and len(moe.experts.local_experts) * 2 == moe.experts.num_experts
    tier = dict(num_kv_pages=40, host_kv_size_gib=0.002, max_model_len=128)
    got = _expert_parallel(tmp_path, prompts, **tier)
    assert got["rows"] == want
    m = got["metrics"]
    assert m["state_swaps_out"] > 0 and m["state_swaps_in"] > 0 and m["recomputes"] == 0, m
    _assert_logprobs_close(got["logprobs"], want_lp)


def test_expert_parallel_needs_ranks_and_experts(tmp_path):
    with pytest.raises(ValueError, match=r"enable_expert_parallel=True .* data_parallel_size > 1"):
        EngineConfig(enable_expert_parallel=True)
    config = EngineConfig(enable_expert_parallel=True, tensor_parallel_size=2, device="cpu")
    assert config.parallel_config.enable_expert_parallel
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        config.resolve(config.torch_device(), moe=False)
    assert config.resolve(config.torch_device(), moe=True).enable_expert_parallel
    save_tiny_model(tmp_path, "LlamaForCausalLM")
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        LLM(str(tmp_path), tensor_parallel_size=2, **EP, **KW)


@pytest.mark.slow
def test_int4_experts_ep2_equal_one_process(tmp_path):
    """Routed experts packed INT4 (Kimi-K2-Thinking's split) go through the all-to-all as
    plain ones do: the greedy rows of one process on the same checkpoint."""
    int4, plain = tmp_path / "int4", tmp_path / "plain"
    for d in (int4, plain):
        d.mkdir()
        save_tiny_deepseek(d, first_k_dense_replace=1, n_shared_experts=1)
    write_pack_quantized(int4, plain, lambda n: ".mlp.experts." in n, 32, KIMI_K2_THINKING_IGNORE)
    prompts = _prompts(seed=3, head=8, tails=(1, 12))
    want, _, _ = _reference(int4, prompts, max_model_len=64)
    llm = LLM(str(int4), tensor_parallel_size=2, **EP, **KW, num_kv_pages=200, max_model_len=64)
    try:
        got = _rows(llm.generate(prompts, PARAMS, use_tqdm=False))
        experts = llm.engine.model.layers[1].mlp.experts
    finally:
        llm.engine.shutdown()
    assert got == want
    assert experts.group_size == 32 and experts.local_experts == range(0, 4)
