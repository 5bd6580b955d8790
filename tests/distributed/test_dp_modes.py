"""Attention data parallel's rounds and their modes (runner/paired.py, distributed/
lockstep.py) in the engine, on four spawned gloo ranks: rank 0 decodes while rank 1
prefills and ranks 2 and 3 have nothing, on tiny DeepSeek-V3 and Kimi Linear checkpoints
in the default configuration (pipelined decode, EOS endings). A decode step beside a
prefill runs eagerly under the variable expert-parallel exchange; decode steps beside
decodes and an idle rank run the fixed-capacity one on every rank (on the CPU, eagerly:
the GPU's graph replays), sized by the largest rank's decode bucket; every rank runs
each forward in the same mode, and the greedy and sampled fp32 tokens are one
process's. A rank that sized its exchange by its own bucket instead breaks the
collectives' shapes: gloo aborts that rank and the test fails."""

from __future__ import annotations

import shutil

import pytest
from deepseek_ranks import (
    KW,
    generated,
    mixed_params,
    one_process,
    save_with_emitted_eos,
    shared_head_prompts,
)
from kimi_ranks import KW as KIMI_KW

from batchgen import LLM
from batchgen.engine.dp_attention import DPEngine

MODES = ("dp_fixed_forwards", "dp_variable_forwards")
SIZE = 4  # ranks: the tiny checkpoints' 8 routed experts divide by it


def _staggered(llm: LLM, first: list[int], then: list[int], params) -> dict[str, tuple]:
    """Two requests on `first` (rank 0, the fewest tokens held; a prompt's samples stay
    on its rank), two ticks, then two on `then` (rank 1), stepped
    to the end (ranks 2 and 3 idle): each request's tokens and finish reason, by id."""
    engine = llm.engine
    assert isinstance(engine, DPEngine)
    for rid, ids, p in (("a0", first, params[0]), ("a1", first, params[1])):
        engine.add_request(rid, ids, p)
    done = [r for _ in range(2) for r in engine.step()]
    for rid, ids, p in (("b0", then, params[2]), ("b1", then, params[3])):
        engine.add_request(rid, ids, p)
    assert [held > 0 for held in engine.held] == [True, True, False, False]
    while engine.has_unfinished:
        done += engine.step()
    return {r.request_id: (r.output_token_ids, r.finish_reason) for r in done}


def _check_modes(ranks: list[dict]) -> None:
    """Every rank ran each forward in the round's mode, so the same count of each; the
    decoding rank ran a decode eagerly beside the prefill; the idle ranks prefilled
    nothing and paired forwards in both modes."""
    for key in MODES:
        assert len({m[key] for m in ranks}) == 1, (key, [m[key] for m in ranks])
    assert ranks[0]["dp_eager_decodes"] >= 1
    assert ranks[0]["dp_fixed_forwards"] >= 4  # the decode steps beside rank 1's
    # a FIXED round's exchange is sized by the largest rank's decode bucket (two
    # requests a rank: 1 or 2), on every rank alike, not by max_num_seqs
    fixed = ranks[0]["dp_fixed_forwards"]
    assert len({m["dp_fixed_tokens"] for m in ranks}) == 1
    assert fixed <= ranks[0]["dp_fixed_tokens"] <= 2 * fixed
    for idle in ranks[2:]:
        assert idle["prompt_tokens"] == 0
        every = idle["dp_fixed_forwards"] + idle["dp_variable_forwards"]
        assert idle["dp_dummy_forwards"] == every
        assert idle["dp_fixed_dummies"] == idle["dp_fixed_forwards"]
        assert idle["dp_variable_forwards"] >= 2  # rank 0's prefill and rank 1's


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> str:
    return save_with_emitted_eos(tmp_path_factory.mktemp("deepseek_dp_modes"))


@pytest.mark.slow
def test_deepseek_dp4_modes_and_tokens_equal_one_process(deepseek):
    """Rank 0's requests decode while rank 1's prefill, ranks 2 and 3 idle; then both
    decode, until rank 1's stop on EOS (5 tokens) and rank 0's run to their length."""
    first, _, then = shared_head_prompts(3)
    params = mixed_params(4)
    ids = ["a0", "a1", "b0", "b1"]
    want = one_process(deepseek, [first, first, then, then], params)
    llm = LLM(deepseek, **KW, data_parallel_size=SIZE, enable_expert_parallel=True)
    try:
        got = _staggered(llm, first, then, params)
        ranks = llm.engine.rank_metrics()
    finally:
        llm.engine.shutdown()
    assert [got[rid] for rid in ids] == want
    assert {reason for _, reason in want} == {"stop", "length"}
    _check_modes(ranks)


@pytest.mark.slow
def test_kimi_linear_dp4_modes_and_tokens_equal_one_process(tmp_path):
    """The same on Kimi Linear (KDA and MLA layers, MoE): each rank's KDA state slots
    are its own; its EOS a token one process emits mid-way."""
    pytest.importorskip("transformers.models.kimi_linear")
    from kimi_checkpoints import save_tiny_kimi
    from penalty_reference import emitted_eos, set_eos

    F, L = "full_attention", "linear_attention"
    save_tiny_kimi(tmp_path, layer_types=[L, L, L, F], first_k_dense_replace=1)
    first, then = [7, 11, 13, 17, 19, 23], [31 + i for i in range(70)]
    params = mixed_params(4)
    kw = dict(KIMI_KW, num_kv_pages=400)

    def one(path, prompts, params):
        llm = LLM(str(path), **kw)
        try:
            return generated(llm, prompts, params)
        finally:
            llm.engine.shutdown()

    plain = one(tmp_path, [first, then], params[:1] * 2)
    eos = tmp_path / "eos"
    shutil.copytree(tmp_path, eos, ignore=shutil.ignore_patterns("eos"))
    set_eos(eos, emitted_eos([tokens for tokens, _ in plain]))
    want = one(eos, [first, first, then, then], params)
    llm = LLM(str(eos), **kw, data_parallel_size=SIZE, enable_expert_parallel=True)
    try:
        got = _staggered(llm, first, then, params)
        ranks = llm.engine.rank_metrics()
    finally:
        llm.engine.shutdown()
    assert [got[rid] for rid in ["a0", "a1", "b0", "b1"]] == want
    assert "stop" in {reason for _, reason in want}
    _check_modes(ranks)
