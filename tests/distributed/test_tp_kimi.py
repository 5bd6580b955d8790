"""Kimi Linear (KDA + NoPE MLA + MoE) at tensor_parallel_size=2 (this process rank 0, one
spawned gloo worker) against tensor_parallel_size=1 on a tiny random checkpoint: KDA and
MLA heads split, experts in one block per rank, each rank's state slots holding its KDA
heads. The same greedy tokens and logprobs within 1e-4 (every request asks for one, so
decode is not pipelined), the engine's defaults otherwise (EOS may end a request,
chunked prefills across the KDA chunk size); then with the host tier forcing swaps of
pages and state slots and state checkpoints serving prefix hits (batchgen_debug reading
each copy back), the worker replaying every copy on its own shard."""

from __future__ import annotations

import pytest
from kimi_checkpoints import save_tiny_kimi
from kimi_ranks import KW, kimi_prompts
from tp_workers import count_mirrored

from batchgen import LLM, SamplingParams

pytest.importorskip("transformers.models.kimi_linear")

F, L = "full_attention", "linear_attention"
PARAMS = SamplingParams(temperature=0, max_tokens=12, logprobs=1)


def _rows(outs) -> list[tuple[list[int], list[float]]]:
    rows = []
    for out in outs:
        c = out.outputs[0]
        rows.append((c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return rows


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-kimi")
    save_tiny_kimi(path, layer_types=[L, L, L, F], first_k_dense_replace=1)
    llm = LLM(str(path), num_kv_pages=400, **KW)
    return str(path), _rows(llm.generate(kimi_prompts(), PARAMS, use_tqdm=False))


def _assert_same(got, want) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    err = max(abs(a - b) for (_, x), (_, y) in zip(got, want) for a, b in zip(x, y))
    assert err < 1e-4, err


def test_tp2_equals_tp1(reference):
    path, want = reference
    llm = LLM(path, tensor_parallel_size=2, num_kv_pages=400, **KW)
    try:
        got = _rows(llm.generate(kimi_prompts(), PARAMS, use_tqdm=False))
    finally:
        llm.engine.shutdown()
    _assert_same(got, want)


def test_tp2_with_the_host_tier_swapping_pages_and_state(reference, monkeypatch):
    """A pool too small for the batch: requests swap their pages and state slots to host
    and back; a second call hits the shared head through a state checkpoint. Both calls
    equal the TP=1 ample run; the worker replays every copy rank 0 sent, state copies
    included, and reads each store back (batchgen_debug)."""
    path, want = reference
    sent = count_mirrored(monkeypatch)
    llm = LLM(
        path,
        tensor_parallel_size=2,
        num_kv_pages=50,
        host_kv_size_gib=0.002,
        state_checkpoint_interval=16,
        batchgen_debug=True,
        **KW,
    )
    try:
        runs = [_rows(llm.generate(kimi_prompts(), PARAMS, use_tqdm=False)) for _ in range(2)]
        (worker,) = llm.engine.tier_worker_metrics()
        m = llm.engine.metrics()
    finally:
        llm.engine.shutdown()
    for got in runs:
        _assert_same(got, want)
    assert m["state_swaps_out"] > 0 and m["state_swaps_in"] > 0
    assert m["state_checkpoint_hit_tokens"] > 0
    assert worker["state_stores"] == sent["state_store"] > 0
    assert worker["state_loads"] == sent["state_load"] > 0
    assert worker["stores"] == sent["store"] and worker["loads"] == sent["load"]
    # a page or a slot read back is one check on every rank
    assert worker["readback_checks"] == m["readback_checks"] > 0
