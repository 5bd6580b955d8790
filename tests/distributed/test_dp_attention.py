"""Attention data parallel (data_parallel_size=2, enable_expert_parallel=True: this
process rank 0, one spawned gloo worker) on a tiny random DeepSeek-V3 against one
process: the requests split over the ranks, each rank's latent pages its own requests'
only, the same tokens, a rank with nothing to run still stepping beside the other."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from conftest import save_byte_tokenizer
from deepseek_checkpoints import CONFIGS, save_tiny_deepseek
from deepseek_ranks import (
    GREEDY,
    KW,
    add_long_requests,
    generated,
    mixed_params,
    one_process,
    save_with_emitted_eos,
    shared_head_prompts,
)
from planted_errors import grammar_fails_for, step_until_done

from batchgen import LLM, SamplingParams
from batchgen.config import EngineConfig
from batchgen.distributed.heartbeat import HEARTBEAT_S, SILENT_AFTER_S
from batchgen.distributed.messages import DPMessage
from batchgen.distributed.workers import Workers
from batchgen.engine.dp_attention import DPEngine, wants_dp_attention
from batchgen.engine.dp_rank import _Worker
from batchgen.engine.request import RequestStatus
from batchgen.sampling_params import StructuredOutputsParams

DP_FLAG = dict(enable_expert_parallel=True)
DP = dict(data_parallel_size=2, **DP_FLAG)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_with_emitted_eos(tmp_path_factory.mktemp("deepseek_dp"))


@pytest.mark.slow
def test_dp2_default_configuration_equals_one_process(checkpoint):
    """The engine's defaults (pipelined decode, EOS endings): greedy, seeded and unseeded
    sampled rows draw the same tokens split over two ranks as in one process; both ranks
    ran requests."""
    prompts, params = shared_head_prompts(9), mixed_params(9)
    want = one_process(checkpoint, prompts, params)
    llm = LLM(checkpoint, **KW, **DP)
    try:
        assert isinstance(llm.engine, DPEngine)
        got = generated(llm, prompts, params)
        ranks = llm.engine.rank_metrics()
        summed = llm.engine.metrics()
        moes = [layer.mlp for layer in llm.engine.model.layers[1:]]  # rank 0's
        for moe in moes:  # every MoE layer expert parallel over the ranks' own tokens
            assert moe.experts.local_experts == range(0, 4)  # of 8: expert parallel
            assert moe.ep.local_tokens and moe.ep.size == 2 and moe.tp is None
            # the shared expert replicated: its whole intermediate width on every rank
            assert moe.shared_experts.down_proj.weight.shape[1] == 32
    finally:
        llm.engine.shutdown()
    assert got == want
    assert {r for _, r in got} == {"stop", "length"}
    assert sum(len(t) for t, _ in got) >= 90
    assert [m["prompt_tokens"] > 0 for m in ranks] == [True, True]
    assert sum(m["output_tokens"] for m in ranks) == sum(len(t) for t, _ in got)
    assert summed["output_tokens"] == sum(len(t) for t, _ in got)
    assert summed["prompt_tokens"] == sum(len(p) for p in prompts)


@pytest.mark.slow
def test_dp2_logprobs_within_1e4_of_one_process(checkpoint):
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=1)
    prompts = shared_head_prompts(6)

    def run(**kw):
        llm = LLM(checkpoint, **KW, **kw)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.engine.shutdown()
        return [
            (
                o.outputs[0].token_ids,
                [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
            )
            for o in outs
        ]

    want, got = run(), run(**DP)
    assert [t for t, _ in got] == [t for t, _ in want]
    worst = max(abs(a - b) for (_, la), (_, lb) in zip(got, want) for a, b in zip(la, lb))
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"


@pytest.mark.slow
def test_each_rank_holds_only_its_own_requests_pages(checkpoint):
    """Requests go to the rank holding the fewest tokens; once prefilled, each rank's
    pool holds pages for its own requests alone, as many as their tokens fill."""
    long, short = [5] * 40, [6] * 8
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(checkpoint, **KW, **DP)
    try:
        engine = llm.engine
        for rid, ids in (("a", long), ("b", short), ("c", short), ("d", short)):
            engine.add_request(rid, ids, params)
        # a: 44 tokens on rank 0; b, c, d: 12 each, all on rank 1 (36 < 44)
        assert engine.held == [44, 36]
        for k in range(3):  # a prompt's samples stay together: one prefill serves them
            engine.add_request(f"e#{k}", [7] * 8, params)
        assert engine.held == [44, 36 + 3 * 12]
        engine.abort([f"e#{k}" for k in range(3)])
        waiting = {rid: r.status for rid, r in engine.requests.items()}
        for _ in range(3):  # prefill (24 tokens a step) and a decode
            engine.step()
        pages = engine.rank_pages()
        running = {rid: r.status for rid, r in engine.requests.items()}
    finally:
        llm.engine.shutdown()
    assert waiting == dict.fromkeys("abcd", RequestStatus.WAITING)
    assert running == dict.fromkeys("abcd", RequestStatus.RUNNING)  # what every rank holds
    assert set(pages[0]) == {"a"} and set(pages[1]) == {"b", "c", "d"}
    assert pages[0]["a"] == 11  # 40 prompt tokens and a decoded one, 4 a page
    assert all(3 >= pages[1][rid] >= 2 for rid in "bcd")


@pytest.mark.slow
def test_an_idle_rank_keeps_stepping_beside_a_busy_one(checkpoint):
    """One request: rank 1 has nothing and runs a dummy forward for every forward of
    rank 0. Then a long prompt with one token on rank 0 and a short prompt with many on
    rank 1: rank 0 idles once its request ends, pairing rank 1's forwards. Tokens as in
    one process either way."""
    one, alone = (
        [shared_head_prompts(1)[0]],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    )
    uneven = [[9] * 40, [11] * 8]
    params = [
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    ]
    want_one = one_process(checkpoint, one, alone)
    want_uneven = one_process(checkpoint, uneven, params)
    llm = LLM(checkpoint, **KW, **DP)
    try:
        assert generated(llm, one, alone) == want_one
        first = [m["dp_dummy_forwards"] for m in llm.engine.rank_metrics()]
        got = generated(llm, uneven, params)
        then = [m["dp_dummy_forwards"] for m in llm.engine.rank_metrics()]
    finally:
        llm.engine.shutdown()
    assert first[0] == 0 and first[1] >= 12  # rank 1 paired every forward of rank 0
    assert got == want_uneven
    assert then[0] >= 15  # rank 1's decode steps after rank 0's request ended


def test_data_parallel_needs_expert_parallel_and_experts(tmp_path, tiny_llama):
    with pytest.raises(ValueError, match="batchgen run --data-parallel"):
        LLM(tiny_llama, device="cpu", data_parallel_size=2)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        LLM(tiny_llama, device="cpu", **DP)


def test_tensor_parallel_inside_a_data_parallel_rank_is_refused_saying_what_to_use():
    config = EngineConfig(data_parallel_size=2, tensor_parallel_size=2, **DP_FLAG)
    with pytest.raises(ValueError, match="MLA latent cache") as e:
        wants_dp_attention(config)
    assert "For 4 ranks use data_parallel_size=4 with enable_expert_parallel=True" in str(e.value)
    assert wants_dp_attention(EngineConfig(data_parallel_size=4, **DP_FLAG))


@pytest.mark.slow
def test_a_dead_rank_fails_the_call_naming_it(checkpoint):
    """A worker killed between steps fails the next one; one killed while the ranks
    step (rank 0 in a forward's collective or a lockstep round) fails the call at once,
    naming it, well within 60 s. Work is added until the kill lands: on a busy machine
    the timer's thread may run after the first requests are done."""
    llm = LLM(checkpoint, **KW, **DP)
    try:
        engine = llm.engine
        add_long_requests(engine)
        engine.step()
        worker = engine.workers.processes[0]
        killed = []
        threading.Timer(1.0, lambda: killed.append(time.monotonic()) or worker.kill()).start()
        more = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        rounds = 0
        with pytest.raises(RuntimeError, match=r"data-parallel worker rank\(s\) \[1\] stopped"):
            while engine.has_unfinished or not killed:
                if not engine.has_unfinished:  # done before the kill: more of the same
                    rounds += 1
                    for i, ids in enumerate(shared_head_prompts(4)):
                        engine.add_request(f"more{rounds}-{i}", ids, more)
                engine.step()
        assert killed and time.monotonic() - killed[0] < 60
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_rank_lost_mid_forward_fails_the_call_within_60s_naming_it(checkpoint, sig, monkeypatch):
    """The worker is killed, or stopped (silent: a host gone without closing its
    connections), while rank 0 is inside a forward, just before a MoE layer's
    all-to-all: the call fails naming rank 1 within 60 s (a stopped rank: the
    heartbeats' silence and a slice), not after the tensors' group timeout (120 s).
    The engine's workers beat every 0.5 s and are silent after 5 s here (test_tp_idle.py
    does the same), not HEARTBEAT_S and SILENT_AFTER_S (2 s, 30 s): the stopped case then
    waits seconds, not half a minute. Those two keep the 60 s promise too (first assert)."""
    assert SILENT_AFTER_S + HEARTBEAT_S < 60
    spawn = Workers.spawn  # bound to the class
    shorter = dict(heartbeat_s=0.5, silent_after_s=5.0)
    monkeypatch.setattr(Workers, "spawn", staticmethod(lambda *a, **k: spawn(*a, **shorter, **k)))
    llm = LLM(checkpoint, **KW, **DP)
    engine = llm.engine
    worker = engine.workers.processes[0]
    lost: list[float] = []

    def lose_the_worker(module, args) -> None:  # rank 0's MoE layer, its 3rd call
        calls.append(1)
        if len(calls) == 3:
            os.kill(worker.pid, sig)
            lost.append(time.monotonic())

    calls: list[int] = []
    try:
        add_long_requests(engine)
        engine.model.layers[1].mlp.register_forward_pre_hook(lose_the_worker)
        with pytest.raises(
            RuntimeError, match=r"data-parallel worker rank\(s\) \[1\] stopped"
        ) as e:
            while engine.has_unfinished:
                engine.step()
        assert lost and time.monotonic() - lost[0] < 60
        assert ("no heartbeat" in str(e.value)) == (sig == signal.SIGSTOP)
    finally:
        if worker.is_alive():
            os.kill(worker.pid, signal.SIGKILL)
        engine.shutdown()


def test_every_data_parallel_message_type_has_a_worker_handler():
    assert set(_Worker.HANDLERS) == set(DPMessage.__subclasses__())


@pytest.mark.slow
def test_dp2_host_tier_swaps_latent_pages_and_equals_one_process(checkpoint):
    """A pool too small for either rank's share: each rank swaps its own requests'
    latent pages to its own host tier and back; the tokens stay the ample run's."""
    prompts = shared_head_prompts(8)
    want = one_process(checkpoint, prompts, GREEDY)
    tier = dict(KW, num_kv_pages=18, max_model_len=64, host_kv_size_gib=0.001)
    llm = LLM(checkpoint, **tier, **DP)
    try:
        got = generated(llm, prompts, GREEDY)
        ranks = llm.engine.rank_metrics()
    finally:
        llm.engine.shutdown()
    assert got == want
    assert [m["swaps_out"] > 0 and m["swaps_in"] > 0 for m in ranks] == [True, True], ranks


@pytest.mark.slow
def test_dp4_equals_one_process(checkpoint):
    """Four ranks, two routed experts each, an uneven share of six requests."""
    prompts, params = shared_head_prompts(6), mixed_params(6)
    want = one_process(checkpoint, prompts, params)
    llm = LLM(checkpoint, **KW, data_parallel_size=4, enable_expert_parallel=True)
    try:
        got = generated(llm, prompts, params)
        moe = llm.engine.model.layers[1].mlp
        ranks = llm.engine.rank_metrics()
    finally:
        llm.engine.shutdown()
    assert got == want
    assert moe.experts.local_experts == range(0, 2)
    assert [m["prompt_tokens"] > 0 for m in ranks] == [True] * 4


@pytest.mark.slow
def test_a_request_failing_on_a_rank_fails_alone(tmp_path, monkeypatch):
    """A grammar error on rank 0 fails that request alone (RequestsFailed, as one engine
    raises it); the requests both ranks finished in that step come out of the next
    step()."""
    save_tiny_deepseek(tmp_path, **CONFIGS["moe_dense_first"])
    save_byte_tokenizer(tmp_path)  # structured outputs need a tokenizer that spells JSON
    grammar_fails_for(monkeypatch, poison="poison", after=2)  # rank 0's grammar alone
    llm = LLM(str(tmp_path), **KW, **DP)
    engine = llm.engine
    try:
        constrained = SamplingParams(
            max_tokens=20, structured_outputs=StructuredOutputsParams(json_object=True)
        )
        three = SamplingParams(max_tokens=3, ignore_eos=True)
        engine.add_request("poison", [5, 6, 7], constrained)  # rank 0 (23 tokens held)
        engine.add_request("other", list(range(30, 51)), three)  # rank 1 (24)
        engine.add_request("short", [8, 9, 10], three)  # rank 0 (23 < 24)
        finished, failures = step_until_done(engine)
    finally:
        engine.shutdown()
    assert engine.held == [0, 0]
    assert [e.request_ids for e in failures] == [["poison"]]
    assert "rank 0" in str(failures[0]) and "planted matcher error" in str(failures[0])
    assert sorted(finished) == ["other", "short"]
