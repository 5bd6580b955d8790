"""Sampler: greedy, filters, penalties, min_tokens, seeding and sampling frequencies (CPU)."""

import math

import pytest
import torch

from batchgen.runner.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    request_seed,
)
from batchgen.sampling_params import SamplingParams

CPU = torch.device("cpu")
EOS = 2


def build(params, logits_or_vocab, outputs=None, prompts=None, eos=(EOS,), generator=None):
    vocab = logits_or_vocab if isinstance(logits_or_vocab, int) else logits_or_vocab.shape[1]
    n = len(params)
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    return SamplingMetadata.build(
        params, prompts, outputs, vocab, CPU, list(eos), generator=generator
    )


def sample(params, logits, **kw):
    return Sampler()(logits, build(params, logits, **kw))


def test_greedy_equals_argmax_and_skips_rng():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0) for _ in range(6)]
    meta = build(params, logits)
    assert meta.all_greedy
    state = torch.get_rng_state()
    out = Sampler()(logits, meta)
    assert torch.equal(torch.get_rng_state(), state)  # no noise drawn
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64


def test_mixed_batch_greedy_rows_take_argmax():
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5) for i in range(8)]
    out = sample(params, logits)
    assert not build(params, logits).all_greedy
    assert torch.equal(out.sampled_token_ids[1::2], logits[1::2].argmax(-1))


def test_raw_logprobs_ranks_and_topk():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(2)) * 3
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.5, logprobs=4, repetition_penalty=1.7, seed=i)
        for i in range(4)
    ] + [SamplingParams(temperature=0.0, presence_penalty=1.5, logprobs=2)]
    outputs = [[int(logits[i].argmax()), 3] for i in range(5)]
    out = sample(params, logits, outputs=outputs, prompts=[[1, 4, 5]] * 5)
    assert torch.equal(logits, before)  # input not modified
    ref = torch.log_softmax(logits, dim=-1)
    ids = out.sampled_token_ids
    torch.testing.assert_close(out.sampled_logprobs, ref.gather(1, ids[:, None]).squeeze(1))
    order = ref.argsort(dim=-1, descending=True)
    ranks = (order == ids[:, None]).nonzero()[:, 1] + 1
    assert torch.equal(out.sampled_ranks, ranks)
    assert out.topk_token_ids.shape == (5, 4)
    assert torch.equal(out.topk_token_ids, order[:, :4])
    torch.testing.assert_close(out.topk_logprobs, ref.gather(1, order[:, :4]))


def test_no_topk_when_no_logprobs_asked():
    logits = torch.randn(2, 10)
    out = sample([SamplingParams(), SamplingParams(temperature=0.0)], logits)
    assert out.topk_token_ids is None and out.topk_logprobs is None
    assert build([SamplingParams()], logits).max_logprobs == 0


def test_top_k_one_is_greedy_at_temperature_one():
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.0, top_k=1) for _ in range(64)]
    out = sample(params, logits, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_tiny_top_p_is_argmax():
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=2.0, top_p=1e-6, seed=i) for i in range(64)]
    assert torch.equal(sample(params, logits).sampled_token_ids, logits.argmax(-1))


def frequencies(params, probs, n, seed=0):
    logits = torch.log(torch.tensor(probs)).expand(n, -1).contiguous()
    out = sample([params] * n, logits, generator=torch.Generator().manual_seed(seed))
    return torch.bincount(out.sampled_token_ids, minlength=len(probs)).double() / n


def chi_square(freq, expected, n):
    expected = torch.tensor(expected, dtype=torch.float64)
    keep = expected > 0
    return float((n * (freq - expected)[keep] ** 2 / expected[keep]).sum())


CHI2_3DOF_P001 = 16.27


def test_min_p_filters_unlikely_tokens():
    probs = [0.5, 0.3, 0.15, 0.05]  # min_p 0.35 -> threshold 0.175: keeps tokens 0 and 1
    n = 8000
    freq = frequencies(SamplingParams(min_p=0.35), probs, n)
    assert freq[2] == 0 and freq[3] == 0
    assert chi_square(freq, [0.625, 0.375, 0, 0], n) < 6.63  # 1 dof, p = 0.01


def test_sampling_frequencies_match_distribution():
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 20000
    freq = frequencies(SamplingParams(), probs, n)
    assert chi_square(freq, probs, n) < CHI2_3DOF_P001
    # Temperature 2 flattens to p ** 0.5, renormalised.
    flat = [p**0.5 for p in probs]
    flat = [p / sum(flat) for p in flat]
    freq = frequencies(SamplingParams(temperature=2.0), probs, n, seed=1)
    assert chi_square(freq, flat, n) < CHI2_3DOF_P001
    # top_p 0.75 drops token 0 (ascending cumsum 0.1 <= 0.25) and renormalises the rest.
    freq = frequencies(SamplingParams(top_p=0.75), probs, n, seed=2)
    assert freq[0] == 0
    assert chi_square(freq, [0, 2 / 9, 3 / 9, 4 / 9], n) < 13.82  # 2 dof, p = 0.001


def test_seeded_rows_sample_the_distribution():
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 4000
    logits = torch.log(torch.tensor(probs)).expand(n, -1).contiguous()
    params = [SamplingParams(seed=s) for s in range(n)]
    ids = sample(params, logits).sampled_token_ids
    freq = torch.bincount(ids, minlength=4).double() / n
    assert chi_square(freq, probs, n) < CHI2_3DOF_P001


def penalised_logits(logits, params, prompts, outputs):
    meta = build(params, logits, outputs=outputs, prompts=prompts)
    return apply_penalties(logits, meta)


LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
PROMPT = [[0, 1]]
OUTPUT = [[3, 3, 4]]


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        # repetition 2 on prompt+output tokens {0, 1, 3, 4}: positive / 2, negative * 2
        ({"repetition_penalty": 2.0}, [1.0, -2.0, 0.5, 1.5, -4.0, 1.0]),
        # frequency 0.5 * output counts (token 3 twice, token 4 once)
        ({"frequency_penalty": 0.5}, [2.0, -1.0, 0.5, 2.0, -2.5, 1.0]),
        # presence 0.25 once per output token (prompt tokens untouched)
        ({"presence_penalty": 0.25}, [2.0, -1.0, 0.5, 2.75, -2.25, 1.0]),
        # all three, repetition first
        (
            {"repetition_penalty": 2.0, "frequency_penalty": 0.5, "presence_penalty": 0.25},
            [1.0, -2.0, 0.5, 0.25, -4.75, 1.0],
        ),
        # negative penalties encourage
        ({"frequency_penalty": -1.0}, [2.0, -1.0, 0.5, 5.0, -1.0, 1.0]),
    ],
)
def test_penalties_match_hand_computed(kwargs, expected):
    got = penalised_logits(LOGITS, [SamplingParams(**kwargs)], PROMPT, OUTPUT)
    torch.testing.assert_close(got, torch.tensor([expected]))


def test_penalties_leave_other_rows_alone_and_steer_greedy():
    logits = torch.cat([LOGITS, LOGITS])
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0), SamplingParams()]
    got = penalised_logits(logits, params, PROMPT * 2, OUTPUT * 2)
    torch.testing.assert_close(got[1], LOGITS[0])
    out = sample([SamplingParams(temperature=0.0, frequency_penalty=2.0)], LOGITS, outputs=OUTPUT)
    assert int(out.sampled_token_ids[0]) == 0  # token 3 drops to -1.0
    assert build([SamplingParams()], LOGITS).output_token_counts is None


def test_penalty_kernel_path_draws_what_the_torch_path_draws():
    """Sampler(kernels=True) (the one-pass penalty kernel, interpreted here) and the torch
    path on penalised, min_tokens and plain rows: the same tokens, step after step."""
    gen = torch.Generator().manual_seed(4)
    vocab = 300
    params = [
        SamplingParams(temperature=0.9, repetition_penalty=1.4, frequency_penalty=0.5, seed=1),
        SamplingParams(temperature=0.0, presence_penalty=2.0, min_tokens=2),
        SamplingParams(temperature=1.1, top_p=0.8, seed=3),
        SamplingParams(temperature=0.7, frequency_penalty=-0.4, min_tokens=4, seed=4),
    ]
    prompts = [[5, 6, 7], [8], [9, 9], [10]]
    outputs = [[], [], [], []]
    for _ in range(4):
        logits = torch.randn(4, vocab, generator=gen) * 2
        logits[:, EOS] = 8.0  # min_tokens rows must not take it yet
        meta = build(params, logits, outputs=outputs, prompts=prompts)
        got = Sampler(kernels=True)(logits, meta).sampled_token_ids
        want = Sampler(kernels=False)(logits, meta).sampled_token_ids
        assert torch.equal(got, want)
        for out, t in zip(outputs, got.tolist()):
            out.append(t)
    assert EOS not in outputs[1][:2] and outputs[1][2] == EOS  # min_tokens held, then not


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.zeros(4, 10)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    logits[:, 5] = 8.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[7]),
        SamplingParams(temperature=0.0, min_tokens=3),
    ]
    outputs = [[1, 1], [1], [], [1, 1, 1]]  # the last row has reached min_tokens
    ids = sample(params, logits, outputs=outputs).sampled_token_ids.tolist()
    assert ids == [7, 5, EOS, EOS]
    ids = sample(params[:1], logits[:1], outputs=[[]], eos=(EOS, 7)).sampled_token_ids
    assert ids.tolist() == [5]


def test_seeded_row_independent_of_neighbours():
    vocab = 1000
    gen = torch.Generator().manual_seed(5)
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    neighbours = [
        SamplingParams(seed=7),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5),
        SamplingParams(seed=99, min_p=0.1),
        SamplingParams(presence_penalty=1.0),
        SamplingParams(temperature=0.3, seed=1234),
        SamplingParams(),
    ]
    for step in range(20):
        row = torch.randn(1, vocab, generator=gen)
        alone = sample([target], row, outputs=[[0] * step])
        logits = torch.randn(8, vocab, generator=gen)
        logits[5] = row[0]
        params = neighbours[:5] + [target] + neighbours[5:]
        outputs = [[1] * (i + 3) for i in range(8)]
        outputs[5] = [0] * step
        batched = sample(params, logits, outputs=outputs)
        assert batched.sampled_token_ids[5] == alone.sampled_token_ids[0], step


def test_different_seeds_and_steps_differ():
    vocab = 1000
    logits = torch.zeros(1, vocab)
    draws = {}
    for seed in (1, 2):
        draws[seed] = [
            int(sample([SamplingParams(seed=seed)], logits, outputs=[[0] * s]).sampled_token_ids)
            for s in range(50)
        ]
    assert sum(a != b for a, b in zip(draws[1], draws[2])) > 40
    assert len(set(draws[1])) > 40  # the step changes the noise
    again = sample([SamplingParams(seed=1)], logits, outputs=[[0] * 7]).sampled_token_ids
    assert int(again) == draws[1][7]


def test_seeds_override_params_seed():
    """The engine's per-request seeds: an unseeded row given a seed samples as a row
    seeded with it, and a row given None gets a seed from the build's generator."""
    vocab = 1000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    outputs = [[0] * 4, [0] * 9, []]
    params = [SamplingParams(), SamplingParams(seed=5, top_k=50), SamplingParams()]
    seeded = [SamplingParams(seed=77), SamplingParams(seed=78, top_k=50), SamplingParams()]
    given = SamplingMetadata.build(
        params,
        [[]] * 3,
        outputs,
        vocab,
        CPU,
        [EOS],
        seeds=[77, 78, None],
        generator=torch.Generator().manual_seed(3),
    )
    assert given.seeds[:2].tolist() == [77, 78]
    a = Sampler()(logits, given).sampled_token_ids
    b = sample(seeded, logits, outputs=outputs, generator=torch.Generator().manual_seed(3))
    assert a.tolist() == b.sampled_token_ids.tolist()
    assert len({request_seed(0, i) for i in range(100)} | {request_seed(1, 0)}) == 101
    assert all(0 <= request_seed(s, 3) < 2**63 for s in (-1, 0, 2**70))


def test_no_nan_when_all_but_one_token_filtered():
    logits = torch.full((3, 20), float("-inf"))
    logits[:, 4] = 1.0
    logits[2] = torch.randn(20)
    logits[2, 9] = 100.0
    params = [
        SamplingParams(temperature=0.5, top_p=0.9, min_p=0.5, logprobs=3),
        SamplingParams(temperature=1.0, top_k=3, seed=3),
        SamplingParams(temperature=1e-3, top_k=1, min_p=1.0, top_p=0.1),
    ]
    out = sample(params, logits)
    assert out.sampled_token_ids.tolist() == [4, 4, 9]
    assert not torch.isnan(out.sampled_logprobs).any()
    assert not torch.isnan(out.topk_logprobs).any()
    torch.testing.assert_close(out.sampled_logprobs[:2], torch.zeros(2))
    assert out.sampled_ranks.tolist() == [1, 1, 1]


def test_tiny_temperature_is_greedy_and_build_shapes():
    params = [SamplingParams(temperature=1e-7, top_k=3, seed=1), SamplingParams(top_k=500)]
    meta = build(params, 100)
    assert meta.temperature.tolist() == [0.0, 1.0]
    assert meta.top_k.tolist() == [0, 0]  # greedy row and k >= vocab disable top_k
    assert meta.top_k.dtype == torch.int64 and meta.temperature.dtype == torch.float32
    assert not meta.use_top_k and meta.max_top_k == 0
    assert math.isclose(float(meta.top_p[1]), 1.0)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def mixed_batch(vocab):
    params = [
        SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.3),
        SamplingParams(seed=11, top_k=20, top_p=0.9, min_p=0.05, frequency_penalty=0.5),
        SamplingParams(min_tokens=4, presence_penalty=0.7, stop_token_ids=[9]),
        SamplingParams(seed=12, temperature=0.7),
    ]
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9]]
    outputs = [[10, 11, 10], [12], [13, 13], []]
    return params, prompts, outputs


@pytest.mark.gpu
@needs_cuda
def test_cuda_call_has_no_host_sync():
    vocab, dev = 5000, torch.device("cuda")
    params, prompts, outputs = mixed_batch(vocab)
    meta = SamplingMetadata.build(params, prompts, outputs, vocab, dev, [EOS])
    logits = torch.randn(4, vocab, device=dev).clamp(-3, 3).to(torch.bfloat16)
    # row 0 (greedy, repetition_penalty 1.3): token 10, an output, leads at 5.0 but is
    # divided to 5.0 / 1.3 = 3.85, below token 42 (seen nowhere) at 4.5
    logits[0, 10], logits[0, 42] = 5.0, 4.5
    sampler = Sampler()
    sampler(logits, meta)  # warm-up: lazy CUDA initialisation may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler(logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids.device.type == "cuda"
    assert out.topk_logprobs.shape == (4, 5)
    assert int(out.sampled_token_ids[0]) == 42


@pytest.mark.gpu
@needs_cuda
def test_cuda_engine_seeds_have_no_host_sync():
    """Every sampled row seeded (as the engine seeds them): still no host sync."""
    vocab, dev = 5000, torch.device("cuda")
    params, prompts, outputs = mixed_batch(vocab)
    seeds = [request_seed(0, i) for i in range(4)]
    logits = torch.randn(4, vocab, device=dev, dtype=torch.bfloat16)
    sampler = Sampler()
    meta = SamplingMetadata.build(params, prompts, outputs, vocab, dev, [EOS], seeds=seeds)
    sampler(logits, meta)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        meta = SamplingMetadata.build(params, prompts, outputs, vocab, dev, [EOS], seeds=seeds)
        out = sampler(logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids.device.type == "cuda"


@pytest.mark.gpu
@needs_cuda
def test_cuda_seeded_row_independent_of_neighbours():
    vocab, dev = 32000, torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    params, prompts, outputs = mixed_batch(vocab)
    for step in range(10):
        logits = torch.randn(4, vocab, device=dev, generator=gen)
        outputs[3] = [0] * step
        alone = SamplingMetadata.build(params[3:], prompts[3:], outputs[3:], vocab, dev, [EOS])
        batch = SamplingMetadata.build(params, prompts, outputs, vocab, dev, [EOS])
        a = Sampler()(logits[3:].clone(), alone).sampled_token_ids
        b = Sampler()(logits, batch).sampled_token_ids
        assert int(a[0]) == int(b[3]), step
