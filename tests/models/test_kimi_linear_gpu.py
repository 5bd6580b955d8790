"""Kimi Linear on the GPU in the default configuration (bf16, Triton MLA, decode CUDA
graphs binding the KDA state slots, pipelined decode, EOS and stop-string endings)
against the same engine asked for logprobs; against the same engine decoding eagerly,
no row may collapse under the logprob-closeness rule; and with
a device pool too small for the batch, the host tier swaps pages and state slots between
graph replays (debug readback on) without breaking a row: against the same small pool
decoded eagerly (the MoE model), and against an ample pool (a dense model)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import record_queued
from parity import collapsed, completions, top5_after
from test_kimi_linear import save_tiny_kimi

from batchgen import LLM, SamplingParams
from batchgen.eval.closeness import close_under_top5, ending_mismatch, top5_from_logprobs

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

L, F = "linear_attention", "full_attention"
KW = dict(device="cuda", dtype="bfloat16", page_size=16, max_model_len=512, max_num_seqs=32)
# the KDA heads of tests/layers/test_kda_gpu.py (4 of 128 x 128): fla-core keys its
# kernels' autotuning on them, so this file reuses what that one compiled and tuned
LINEAR = dict(linear_num_heads=4, linear_head_dim=128)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi-gpu")
    save_tiny_kimi(path, layer_types=[L, L, L, F], **LINEAR)
    return str(path)


def _collapsed(rows, ref, llm) -> int:
    """Rows not close to ref's under the logprob-closeness rule, endings included: the
    requests end at the model's EOS (no ignore_eos) or by length."""
    return collapsed(rows, ref, llm.engine.eos_token_ids)


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randint(3, 500) for _ in range(rng.randint(5, 150))] for _ in range(n)]


@pytest.mark.parametrize("n", [3, 32])
def test_graphs_match_eager_decode(model_dir, n):
    prompts = _prompts(n)
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=5)
    eager = LLM(model=model_dir, num_kv_pages=1024, enforce_eager=True, **KW)
    assert eager.engine.runner.graphs is None
    ref = completions(eager, prompts, params)
    llm = LLM(model=model_dir, num_kv_pages=1024, **KW)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.linear_states is not None
    rows = completions(llm, prompts, params)
    assert graphs.graphs, "decode steps should have replayed graphs"
    assert _collapsed(rows, ref, llm) == 0


def test_default_configuration_stays_close_to_the_logprobs_run(dense_model_dir):
    """What users run on a GPU: decode graphs with pipelined decode (no logprobs asked),
    EOS and stop-string endings. Against the same engine asked for 5 logprobs (graphs
    replayed a step at a time, not pipelined), no row may collapse under the
    logprob-closeness rule; the default run's own top five at a row's first divergence
    come from a one-token request on its prefix. The dense model: a row that stops
    computes one token more in the pipelined run (discarded), so the batches differ,
    and a bf16 router would flip expert choices on that alone (see
    test_swaps_between_graph_replays)."""
    prompts = _prompts(32)
    stop = ["w7"]  # the test tokenizer's words w7 and w70-w79: ~2% of the vocabulary
    llm = LLM(model=dense_model_dir, num_kv_pages=1024, **KW)
    queued = record_queued(llm.engine.runner)
    plain = SamplingParams(temperature=0, max_tokens=48, stop=stop)
    outs = [o.outputs[0] for o in llm.generate(prompts, plain, use_tqdm=False)]
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    assert any(queued), "no decode step was queued ahead"
    assert {o.finish_reason for o in outs} == {"stop", "length"}, "both endings seen"
    params = SamplingParams(
        temperature=0,
        max_tokens=48,
        stop=stop,
        logprobs=5,  # off-defaults: the reference run
    )
    ref = completions(llm, prompts, params)
    broken, eos = [], llm.engine.eos_token_ids
    for p, (o, r) in enumerate(zip(outs, ref, strict=True)):
        ours, ends = list(o.token_ids), (o.finish_reason, r.finish_reason)
        if not close_under_top5(
            ours,
            r.token_ids,
            lambda i, p=p, ours=ours: top5_after(llm, prompts[p], ours, i),
            top5_from_logprobs(r.logprobs),
            a_finish=ends[0],
            b_finish=ends[1],
            eos_ids=eos,
        ):
            broken.append((p, ending_mismatch(ours, r.token_ids, *ends, eos)))
    assert not broken, f"rows collapsed (row, ending mismatch): {broken}"


TIGHT = dict(num_kv_pages=60, host_kv_size_gib=0.25, batchgen_debug=True)


def _swapped(llm) -> dict:
    m = llm.engine.metrics()
    assert m["state_swaps_out"] > 0 and m["state_swaps_in"] > 0, m
    assert m["recomputes"] == 0 and m["readback_checks"] > 0, m
    return {k: m[k] for k in ("state_swaps_out", "state_swaps_in", "preemptions")}


def test_swaps_between_graph_replays(model_dir):
    """The MoE model: a bf16 router flips an expert choice at a near-tie whenever the batch
    around a row changes (tests/models/test_deepseek_v3_gpu.py measured it), and a small
    pool changes every batch. So the reference is the same small pool decoded eagerly: the
    same schedule, the same swaps (scheduling does not depend on graphs), and no row may
    collapse. A graph replay that read a slot a swap moved, or a state a swap-in had not
    yet written, would collapse its row here."""
    prompts = _prompts(32)
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=5)
    eager = LLM(model=model_dir, enforce_eager=True, **TIGHT, **KW)
    ref = completions(eager, prompts, params)
    tight = LLM(model=model_dir, **TIGHT, **KW)
    rows = completions(tight, prompts, params)
    assert tight.engine.runner.graphs is not None and tight.engine.runner.graphs.graphs
    assert _swapped(tight) == _swapped(eager)
    assert _collapsed(rows, ref, tight) == 0


@pytest.fixture(scope="module")
def dense_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi-gpu-dense")
    save_tiny_kimi(path, layer_types=[L, L, L, F], first_k_dense_replace=4, **LINEAR)
    return str(path)


@pytest.mark.parametrize("scatter", ["copy", "compute"])
def test_swaps_keep_a_dense_model_on_the_ample_run(dense_model_dir, scatter):
    """Without a router to flip, a row of the small pool (graphs, swaps of pages and state
    slots between replays) stays close to the same row decoded with an ample pool; with
    tier_load_scatter="compute" too, where the loads' scatters run on the compute
    stream."""
    prompts = _prompts(32)
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=5)
    ref = completions(LLM(model=dense_model_dir, num_kv_pages=1024, **KW), prompts, params)
    tight = LLM(model=dense_model_dir, tier_load_scatter=scatter, **TIGHT, **KW)
    rows = completions(tight, prompts, params)
    assert tight.engine.runner.graphs is not None and tight.engine.runner.graphs.graphs
    _swapped(tight)
    assert _collapsed(rows, ref, tight) == 0


def _shared_prefix_prompts(seed: int, longest_suffix: int) -> list[list[int]]:
    """Four groups of four prompts: a shared prefix of 100 tokens, then 3 to
    longest_suffix tokens of their own."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(4):
        prefix = [rng.randint(3, 500) for _ in range(100)]
        prompts += [
            prefix + [rng.randint(3, 500) for _ in range(rng.randint(3, longest_suffix))]
            for _ in range(4)
        ]
    return prompts


def test_prefix_hits_from_state_checkpoints(dense_model_dir):
    """Groups of prompts sharing 100 tokens, checkpoints every 32: each group's later
    requests resume at 96 from the KDA state its first one stored (its pages from the
    cache), with 5 logprobs asked (pipelined decode off) and tier_policy "always"; rows
    stay close to a tier-off run, which has no prefix hits for a hybrid model."""
    prompts = _shared_prefix_prompts(seed=3, longest_suffix=40)
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=5)
    plain = LLM(model=dense_model_dir, num_kv_pages=1024, **KW)
    ref = completions(plain, prompts, params)
    assert plain.engine.kv.prefix_hit_tokens == 0
    llm = LLM(
        model=dense_model_dir,
        num_kv_pages=1024,
        host_kv_size_gib=0.25,
        tier_policy="always",
        state_checkpoint_interval=32,
        **KW,
    )
    rows = completions(llm, prompts, params)
    m = llm.engine.metrics()
    assert m["state_checkpoint_hit_tokens"] >= 4 * 3 * 96, m
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    assert _collapsed(rows, ref, llm) == 0


@pytest.mark.parametrize(
    "setup",
    [
        dict(num_kv_pages=1024),
        dict(num_kv_pages=1024, host_kv_size_gib=0.25, state_checkpoint_interval=32),
    ],
    ids=["ample", "checkpoints"],
)
def test_async_scheduling_matches_plain_steps(dense_model_dir, setup):
    """Async scheduling on a hybrid model: prefill chunks (64 tokens a step) and decode
    graph replays launched while the step before runs, the KDA state slots read and
    written in stream order, the tier's state checkpoints and swaps submitted between
    launches. Requests end by length only and the pool holds them all, so both runs take
    the same steps with the same rows, and the bf16 outputs must be identical. (Under a
    pool too small, async scheduling may take other steps, since a request finishing in
    the step in flight still holds its pages: swaps under it are compared on the CPU, in
    fp32, tests/models/test_kimi_linear_async.py.)"""
    prompts = _shared_prefix_prompts(seed=4, longest_suffix=60)
    params = [
        SamplingParams(temperature=0, max_tokens=8 + i % 23, ignore_eos=True)
        for i in range(len(prompts))
    ]
    runs = []
    for async_ in (False, True):
        llm = LLM(
            model=dense_model_dir,
            async_scheduling=async_,
            max_num_batched_tokens=64,
            **setup,
            **KW,
        )
        used = llm.engine.overlap.name == "async"
        assert used == async_ and llm.engine.runner.graphs is not None
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(([o.outputs[0].token_ids for o in outs], llm.engine.metrics()))
        del llm
    (plain, m_plain), (got, m_async) = runs
    differ = [i for i in range(len(prompts)) if plain[i] != got[i]]
    assert not differ, f"rows {differ}: {[(plain[i], got[i]) for i in differ[:2]]}"
    for key in ("preemptions", "state_checkpoints", "state_checkpoint_hit_tokens"):
        assert m_async.get(key) == m_plain.get(key), key
    assert m_async["preemptions"] == 0, m_async
    if "state_checkpoint_interval" in setup:
        assert m_async["state_checkpoint_hit_tokens"] > 0, m_async
