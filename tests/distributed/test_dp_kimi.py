"""Kimi Linear (KDA + MLA + MoE) under attention data parallel (data_parallel_size=2
or 4, enable_expert_parallel=True: this process rank 0, spawned gloo workers) against
one process on a tiny random checkpoint: the same tokens and EOS endings, each rank its
own requests' latent pages and KDA state slots, and, with a pool too small for its
share, its own host tier swapping both."""

from __future__ import annotations

import shutil

import pytest
from kimi_checkpoints import save_tiny_kimi
from kimi_ranks import KW, kimi_params, kimi_prompts
from penalty_reference import emitted_eos, set_eos

from batchgen import LLM, SamplingParams

pytest.importorskip("transformers.models.kimi_linear")

F, L = "full_attention", "linear_attention"
DP = dict(data_parallel_size=2, enable_expert_parallel=True)


def _logprobs(path: str, **kw) -> tuple[list[list[int]], list[list[float]], list[dict]]:
    """Each row's tokens and its tokens' logprobs, and each rank's metrics."""
    llm = LLM(path, **{**KW, **kw})
    try:
        outs = llm.generate(kimi_prompts(), kimi_params(logprobs=1), use_tqdm=False)
        ranks = llm.engine.rank_metrics() if "data_parallel_size" in kw else []
    finally:
        llm.engine.shutdown()
    samples = [o.outputs[0] for o in outs]
    chosen = [[lp[t].logprob for t, lp in zip(s.token_ids, s.logprobs)] for s in samples]
    return [s.token_ids for s in samples], chosen, ranks


def _outputs(path: str, **kw) -> tuple[list, list[dict]]:
    """Each row's tokens and finish reason, and each rank's metrics (attention data
    parallel: its MoE layers checked expert parallel over every rank's own tokens)."""
    llm = LLM(path, **{**KW, **kw})
    try:
        outs = llm.generate(kimi_prompts(), kimi_params(), use_tqdm=False)
        ranks = []
        if "data_parallel_size" in kw:
            ranks = llm.engine.rank_metrics()
            split = [m.ep for m in llm.engine.model.modules() if getattr(m, "ep", None)]
            size = kw["data_parallel_size"]
            assert split and all(ep.size == size and ep.local_tokens for ep in split)
    finally:
        llm.engine.shutdown()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], ranks


def _run(path: str, **kw) -> tuple[list[list[int]], list[dict]]:
    rows, ranks = _outputs(path, **kw)
    return [tokens for tokens, _ in rows], ranks


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-kimi-dp")
    save_tiny_kimi(path, layer_types=[L, L, L, F], first_k_dense_replace=1)
    return str(path), _run(str(path), num_kv_pages=400)[0]


@pytest.fixture(scope="module")
def with_eos(reference, tmp_path_factory):
    """The checkpoint again, its EOS a token the reference rows emit mid-way (so some
    rows stop on it, others run to max_tokens), and one process's rows on it."""
    path, rows = reference
    copy = tmp_path_factory.mktemp("tiny-kimi-dp-eos")
    shutil.copytree(path, copy, dirs_exist_ok=True)
    set_eos(copy, emitted_eos(rows))
    want, _ = _outputs(str(copy), num_kv_pages=400)
    assert {reason for _, reason in want} == {"stop", "length"}, want
    return str(copy), want


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 4], ids=["dp2", "dp4"])
def test_default_configuration_equals_one_process(with_eos, size):
    """The engine's defaults (pipelined decode, EOS endings): greedy, seeded and unseeded
    sampled rows split over 2 and 4 ranks (experts 4 and 2 a rank) draw one process's
    tokens and endings; every rank ran requests."""
    path, want = with_eos
    dp = dict(DP, data_parallel_size=size)
    got, ranks = _outputs(path, num_kv_pages=400, **dp)
    assert got == want
    assert [m["prompt_tokens"] > 0 for m in ranks] == [True] * size


@pytest.mark.slow
def test_dp2_host_tier_swaps_each_ranks_pages_and_state(reference):
    """A pool of 32 pages a rank: its requests swap their latent pages and state slots
    to its own host tier and back (batchgen_debug reading each copy back on its rank);
    the tokens stay the one-process ample run's, their logprobs within 1e-4 of it."""
    path, want = reference
    _, want_logprobs, _ = _logprobs(path, num_kv_pages=400)
    tier = dict(num_kv_pages=32, max_model_len=128, host_kv_size_gib=0.002)
    got, logprobs, ranks = _logprobs(path, **tier, batchgen_debug=True, **DP)
    assert got == want
    worst = max(abs(a - b) for x, y in zip(logprobs, want_logprobs) for a, b in zip(x, y))
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"
    assert [m["swaps_out"] > 0 and m["swaps_in"] > 0 for m in ranks] == [True, True], ranks
    # batchgen_debug: each rank read back every copy its own tier made
    assert [m["readback_checks"] > 0 for m in ranks] == [True, True], ranks


@pytest.mark.slow
def test_each_rank_holds_its_own_requests_state_slots(reference):
    """Each rank takes state slots from its own pool for its own requests alone: both
    ranks hand out slot 0 first."""
    path, _ = reference
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(path, **{**KW, "num_kv_pages": 400}, **DP)
    try:
        engine = llm.engine
        for i, ids in enumerate(kimi_prompts()[:4]):
            engine.add_request(str(i), ids, params)
        # by tokens held (prompt plus 8): 0 (84) rank 0, 1 (29) and 2 (114) rank 1, 3 (45)
        # rank 0; seven steps of 32 tokens prefill them all, none ends
        for _ in range(7):
            engine.step()
        slots = engine.rank_slots()
        pages = engine.rank_pages()
    finally:
        engine.shutdown()
    assert [set(s) for s in slots] == [{"0", "3"}, {"1", "2"}], slots
    assert [sorted(s.values()) for s in slots] == [[0, 1], [0, 1]]
    assert [set(p) for p in pages] == [set(s) for s in slots]
