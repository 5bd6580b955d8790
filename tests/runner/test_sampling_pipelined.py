"""Penalties and logprobs stay on the pipelined paths: their counts are kept on the
device (sampler.PenaltyCounts) and logprobs come back with the tokens, so decode steps
are still queued ahead (pipelined decode, async scheduling) and the outputs are those
of plain stepping, sampled and greedy, token for token and logprob for logprob."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import count_launches_ahead, record_launches, save_tiny_model

from batchgen import LLM, SamplingParams
from batchgen.runner.penalty_counts import PenaltyCounts, token_stats
from batchgen.runner.sampler import SamplingMetadata

# deterministic: the runs compared batch their rows differently (max_num_seqs, blind
# steps), and only batch-invariant numerics make their tokens bitwise the same on every
# CPU (a BLAS may block a product by its row count); what differs is the bookkeeping
KW = dict(
    device="cpu",
    dtype="float32",
    page_size=4,
    max_model_len=96,
    max_num_batched_tokens=64,
    deterministic=True,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sampling_pipelined")
    save_tiny_model(path, "LlamaForCausalLM")
    return path


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(3)
    prompts = []
    for _ in range(n):
        own = [rng.randint(3, 500) for _ in range(rng.randint(3, 20))]
        prompts.append(own + rng.sample(own, k=2))  # repeats the penalties count
    return prompts


PARAMS = [
    SamplingParams(temperature=0, repetition_penalty=1.8, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=0.9, frequency_penalty=1.2, seed=4, max_tokens=12),
    SamplingParams(temperature=0.7, top_p=0.9, presence_penalty=1.0, max_tokens=16),
    SamplingParams(temperature=1.0, top_k=40, repetition_penalty=1.3, logprobs=3, max_tokens=10),
    SamplingParams(temperature=0, logprobs=2, frequency_penalty=0.5, max_tokens=15),
    SamplingParams(temperature=0.8, presence_penalty=-0.5, repetition_penalty=0.9, max_tokens=13),
]


def _rows(outs):
    rows = []
    for o in outs:
        c = o.outputs[0]
        lps = None
        if c.logprobs is not None:
            lps = [sorted((t, round(v.logprob, 4)) for t, v in d.items()) for d in c.logprobs]
        rows.append((c.token_ids, c.finish_reason, lps))
    return rows


def _generate(model_dir, prompts, params, **kw):
    llm = LLM(model=str(model_dir), seed=3, **{**KW, **kw})
    launches = record_launches(llm.engine.runner)
    ahead = count_launches_ahead(llm.engine.runner)
    rows = _rows(llm.generate(prompts, params, use_tqdm=False))
    engine = llm.engine
    assert not engine.has_unfinished and not engine.requests
    # every slot still held is one the next step releases (schedule() hands them over)
    held = set(engine.runner.penalties._slot)
    assert held <= set(engine.scheduler.take_released())
    behind = [f.sampled for f, b in launches if b]  # a decode step: every row samples
    _generate.preemptions = engine.scheduler.num_preemptions
    return rows, behind, ahead


def _penalised_ahead(steps) -> int:
    return sum(any(r.params.has_penalties for r in rows) for rows in steps)


def test_pipelined_decode_queues_penalised_rows_ahead(model_dir):
    prompts = _prompts(12)
    params = [PARAMS[i % len(PARAMS)] for i in range(12)]
    plain, behind, _ = _generate(model_dir, prompts, params, pipeline_decode=False)
    assert not behind
    piped, behind, _ = _generate(model_dir, prompts, params, max_num_seqs=6)
    assert _penalised_ahead(behind) > 5, "no penalised decode step was queued ahead"
    assert any(any(r.params.logprobs for r in rows) for rows in behind)
    assert piped == plain
    assert any(lps for _, _, lps in piped)  # logprobs came back


def test_async_scheduling_launches_penalised_steps_ahead(model_dir):
    prompts = _prompts(10)
    params = [PARAMS[(i + 1) % len(PARAMS)] for i in range(10)]
    plain, _, _ = _generate(model_dir, prompts, params, pipeline_decode=False)
    rows, _, ahead = _generate(
        model_dir, prompts, params, max_num_seqs=4, pipeline_decode=True, async_scheduling=True
    )
    assert ahead["steps"] > 10, ahead
    assert rows == plain


def test_preempted_penalised_rows_match_plain_steps(model_dir):
    """A small pool: recomputed requests refill their counts from the host's tokens."""
    prompts = _prompts(10)
    params = [PARAMS[i % len(PARAMS)] for i in range(10)]
    small = dict(max_num_seqs=8, num_kv_pages=30)
    plain, _, _ = _generate(model_dir, prompts, params, pipeline_decode=False, **small)
    llm_rows, behind, _ = _generate(model_dir, prompts, params, **small)
    assert _penalised_ahead(behind) > 0
    assert _generate.preemptions > 0
    assert llm_rows == plain


def test_kept_counts_equal_the_host_lists():
    """Counts recorded step by step on the device equal those built from the token
    lists; a released request's slot is reused and refilled; a slot out of step with
    the host's tokens is refilled, and one that cannot be is an error."""
    vocab = 37
    kept = PenaltyCounts(vocab, torch.device("cpu"))
    gen = random.Random(0)
    ids = ["a", "b", "c"]
    prompts = [[gen.randrange(vocab) for _ in range(5)] for _ in ids]
    outputs = [[gen.randrange(vocab) for _ in range(k)] for k in (0, 3, 1)]
    params = [SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3)] * 3
    for _ in range(6):
        meta = SamplingMetadata.build(
            params, prompts, outputs, vocab, torch.device("cpu"), [2],
            penalty_counts=kept, request_ids=ids,
        )  # fmt: skip
        counts, mask = token_stats(3, vocab, torch.device("cpu"), list(enumerate(outputs)),
                                    list(enumerate(prompts)))  # fmt: skip
        assert torch.equal(meta.output_token_counts, counts)
        assert torch.equal(meta.prompt_token_mask, mask)
        tokens = torch.tensor([gen.randrange(vocab) for _ in ids])
        meta.record(tokens)
        for out, t in zip(outputs, tokens.tolist()):
            out.append(t)
    kept.release(["b"])
    assert len(kept) == 2
    args = (prompts[1:], outputs[1:], [len(o) for o in outputs[1:]])
    slots = kept.slots(["d", "c"], *args)  # d takes b's slot, filled from its lists
    assert sorted(slots) != [0, 0] and len(set(slots)) == 2
    assert kept.counts[slots[0]].sum() == len(outputs[1])
    with pytest.raises(RuntimeError, match="penalty counts"):
        kept.slots(["e"], [prompts[0]], [outputs[0]], [len(outputs[0]) + 1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kept_counts_have_no_host_sync():
    """Filling new slots, reading them and recording a step's tokens on the GPU: the
    host never waits (a pipelined step's sampling must not)."""
    vocab, dev = 5000, torch.device("cuda")
    kept = PenaltyCounts(vocab, dev)
    params = [SamplingParams(temperature=0.8, repetition_penalty=1.2, seed=i) for i in range(3)]
    prompts, outputs = [[1, 2, 3], [4], [5, 6]], [[7], [], [8, 8]]

    # the step's tokens are on the device before the window opens: a tensor made from a
    # Python list on the GPU is a synchronising copy of the test's own, not the code's
    tokens = torch.tensor([9, 10, 11], device=dev)

    def step(ids):
        meta = SamplingMetadata.build(
            params, prompts, outputs, vocab, dev, [2], penalty_counts=kept, request_ids=ids
        )
        counts = meta.output_token_counts  # gathered on the device, before the step's tokens
        meta.record(tokens)
        return counts

    step(["a", "b", "c"])  # warm-up: lazy CUDA initialisation may synchronise
    torch.cuda.synchronize()
    for out, t in zip(outputs, (9, 10, 11)):
        out.append(t)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = step(["a", "b", "d"])  # d: a new slot, filled
    finally:
        torch.cuda.set_sync_debug_mode("default")
    counts, _ = token_stats(3, vocab, torch.device("cpu"), list(enumerate(outputs)), [])
    assert torch.equal(got.cpu(), counts)
