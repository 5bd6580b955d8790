"""The sampler's distribution against transformers' logits warpers: which tokens each
filter keeps (top_k, top_p's edge token, min_p), frequencies of many seeded draws (a
chi-square bound: the seed set is fixed, so each test is deterministic, and a wrong
filter or temperature fails it), penalties against RepetitionPenaltyLogitsProcessor,
and a seeded row's draws alone, in a batch, in any row order.

Each runs through the Triton kernels (under the interpreter on the CPU) and through
their torch references (the sampler's CPU path), and on CUDA where there is one."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from batchgen.runner.sampler import Sampler, SamplingMetadata, apply_penalties, request_seed
from batchgen.sampling_params import SamplingParams

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# (device, use the Triton kernels): the kernels under the interpreter, the references
# (conftest turns the interpreter on only where there is no CUDA device)
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is off")
PATHS = [
    pytest.param(CPU, True, id="kernels", marks=interpreted),
    pytest.param(CPU, False, id="reference"),
    pytest.param(torch.device("cuda"), True, id="cuda", marks=[pytest.mark.gpu, needs_cuda]),
]
# the same for thousands of draws, without the interpreted kernels: at ~6 ms a row they
# took ~9 of CI's minutes, and they draw what the references draw, token for token
# (tests/kernels/test_sampling_interpret.py), so the references' frequencies here are
# theirs; on a GPU the compiled kernels run these tests themselves
MANY_DRAWS = PATHS[1:]
# chi-square quantiles at p = 0.001 by degrees of freedom (a correct sampler fails one
# in a thousand seed sets; the seed set is fixed)
CHI2_P001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12,
             9: 27.88, 10: 29.59, 11: 31.26}  # fmt: skip


def meta_for(params, vocab, device, outputs=None, prompts=None, seeds=None):
    n = len(params)
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    return SamplingMetadata.build(params, prompts, outputs, vocab, device, [2], seeds=seeds)


def expected_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """softmax after transformers' warpers in the sampler's order (temperature, min_p,
    top_k, top_p), in float64."""
    scores = logits.double().unsqueeze(0)
    ids = torch.zeros(1, 0, dtype=torch.int64)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    return torch.softmax(scores, dim=-1).squeeze(0)


def draw(logits_row, p, n, device, kernels, step=0):
    """n draws of one request's distribution: n rows with seeds 0 .. n-1."""
    logits = logits_row.expand(n, -1).contiguous().to(device)
    seeds = [request_seed(7, i) for i in range(n)]
    meta = meta_for([p] * n, logits.shape[1], device, outputs=[[0] * step] * n, seeds=seeds)
    return Sampler(kernels=kernels)(logits, meta).sampled_token_ids.cpu()


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, int]:
    """(statistic, degrees of freedom, draws outside the support)."""
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    stat = float(((counts - n * probs)[support] ** 2 / (n * probs[support])).sum())
    return stat, int(support.sum()) - 1, int(counts[~support].sum())


LOGITS = torch.tensor([1.9, -0.3, 0.8, 2.4, -1.2, 1.1, 0.2, 2.0, -0.7, 1.5, 0.5, -2.0])
CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.4, top_k=5),
    SamplingParams(temperature=0.8, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.15),
    SamplingParams(temperature=0.7, top_k=8, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("device,kernels", MANY_DRAWS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_frequencies_match_the_warped_distribution(device, kernels, case):
    p = CASES[case]
    probs = expected_probs(LOGITS, p)
    interpreted = kernels and device.type == "cpu"  # ~6 ms a draw: a third of them
    tokens = draw(LOGITS, p, 1000 if interpreted else 3000, device, kernels)
    stat, dof, outside = chi_square(tokens, probs)
    assert outside == 0
    assert stat < CHI2_P001[dof], (stat, dof)


def test_the_chi_square_bound_fails_a_wrong_distribution():
    """The same draws against what an off-by-one top_k or a forgotten temperature would
    sample: the bound rejects both, so the test above can fail."""
    p = SamplingParams(temperature=1.4, top_k=5)
    tokens = draw(LOGITS, p, 3000, CPU, False)
    wrong_k = expected_probs(LOGITS, SamplingParams(temperature=1.4, top_k=6))
    stat, dof, _ = chi_square(tokens, wrong_k)
    assert stat > CHI2_P001[dof]
    p = SamplingParams(temperature=0.6)
    tokens = draw(LOGITS, p, 3000, CPU, False)
    stat, dof, _ = chi_square(tokens, expected_probs(LOGITS, SamplingParams(temperature=1.0)))
    assert stat > CHI2_P001[dof]


def kept_by_transformers(logits, p):
    return expected_probs(logits, p) > 0


@pytest.mark.parametrize("device,kernels", MANY_DRAWS)
def test_each_filter_keeps_the_tokens_transformers_keeps(device, kernels):
    """On random rows (no ties): the support of the sampled distribution. A row whose
    draws all land in the kept set and cover it: 400 draws of a 40-token vocabulary with
    the filters leaving few tokens, compared as sets."""
    gen = torch.Generator().manual_seed(11)
    checks = 0
    for trial in range(6):
        row = torch.randn(40, generator=gen) * 2
        top_p = float(torch.rand(1, generator=gen)) * 0.5 + 0.2
        for p in (
            SamplingParams(temperature=1.0, top_p=top_p),
            SamplingParams(temperature=0.5 + trial / 4, top_k=1 + trial),
            SamplingParams(temperature=1.0 + trial / 5, min_p=0.3),
        ):
            kept = kept_by_transformers(row, p)
            tokens = draw(row, p, 400, device, kernels, step=trial)
            seen = torch.zeros(40, dtype=torch.bool)
            seen[tokens] = True
            assert not (seen & ~kept).any(), (p, trial)
            if int(kept.sum()) <= 4:  # small sets: 400 draws see every member
                assert torch.equal(seen, kept), (p, trial)
                checks += 1
    assert checks >= 6


@pytest.mark.parametrize("device,kernels", MANY_DRAWS)
def test_the_nucleus_edge_token_is_kept(device, kernels):
    """probs 0.4, 0.3, 0.2, 0.1 and top_p 0.65: the top two (0.7 >= 0.65) are the
    nucleus, the edge token (0.3) included, as TopPLogitsWarper keeps it; 0.75 takes the
    third in too."""
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    logits = probs.log()
    for top_p, support in ((0.65, [1, 3]), (0.75, [1, 2, 3]), (0.35, [1])):
        p = SamplingParams(temperature=1.0, top_p=top_p)
        assert kept_by_transformers(logits, p).nonzero().flatten().tolist() == support
        tokens = draw(logits, p, 600, device, kernels)
        assert sorted(set(tokens.tolist())) == support, top_p
        stat, dof, outside = chi_square(tokens, expected_probs(logits, p))
        assert outside == 0 and (dof == 0 or stat < CHI2_P001[dof])


@pytest.mark.parametrize("device,kernels", MANY_DRAWS)
def test_tied_tokens_at_the_edge_are_kept_together(device, kernels):
    """Two tokens tied at the nucleus edge: both stay (a threshold on values), where a
    sort would keep one of them by its order."""
    probs = torch.tensor([0.5, 0.2, 0.2, 0.1])
    p = SamplingParams(temperature=1.0, top_p=0.6)
    tokens = draw(probs.log(), p, 600, device, kernels)
    assert sorted(set(tokens.tolist())) == [0, 1, 2]
    expected = torch.tensor([5 / 9, 2 / 9, 2 / 9, 0.0], dtype=torch.float64)
    stat, dof, _ = chi_square(tokens, expected)
    assert stat < CHI2_P001[dof]


def test_repetition_penalty_matches_transformers():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 50, generator=gen) * 3
    prompts = [[1, 4, 9, 9], [0], [7, 8]]
    outputs = [[4, 20, 21], [33, 33], []]
    params = [SamplingParams(repetition_penalty=r) for r in (1.1, 1.7, 0.8)]
    got = apply_penalties(logits, meta_for(params, 50, CPU, outputs=outputs, prompts=prompts))
    for i, p in enumerate(params):
        ids = torch.tensor([prompts[i] + outputs[i]])
        want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, logits[i : i + 1])
        torch.testing.assert_close(got[i : i + 1], want)


BATCH = [
    SamplingParams(temperature=0.9, top_p=0.95, seed=1234),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.2, top_k=20, seed=5),
    SamplingParams(temperature=0.7, min_p=0.05, seed=-3),
    SamplingParams(temperature=1.0, top_k=50, top_p=0.8, seed=2**62),
    SamplingParams(temperature=0.5, frequency_penalty=0.4, seed=8),
    SamplingParams(temperature=1.0, seed=9),
]


@pytest.mark.parametrize("device,kernels", PATHS)
def test_a_seeded_row_draws_the_same_alone_and_in_any_batch(device, kernels):
    """Each request alone, in the batch of 7, and in the batch reversed: the same token,
    step after step (the noise is keyed by seed and step only)."""
    vocab = 3000
    gen = torch.Generator().manual_seed(8)
    outputs = [[5] * (i + 1) for i in range(7)]
    sampler = Sampler(kernels=kernels)
    moved = 0
    for step in range(3):
        logits = (torch.randn(7, vocab, generator=gen) * 2).to(device)
        outs = [o + [step] * step for o in outputs]
        batch = sampler(logits, meta_for(BATCH, vocab, device, outputs=outs))
        order = list(reversed(range(7)))
        flipped = sampler(
            logits[order].contiguous(),
            meta_for([BATCH[i] for i in order], vocab, device, outputs=[outs[i] for i in order]),
        )
        batch = batch.sampled_token_ids.tolist()
        assert list(reversed(flipped.sampled_token_ids.tolist())) == batch
        for i in range(7):
            alone = sampler(logits[i : i + 1], meta_for([BATCH[i]], vocab, device, [outs[i]]))
            assert int(alone.sampled_token_ids[0]) == batch[i], (step, i)
        moved += batch != logits.argmax(dim=1).tolist()
    assert moved == 3  # sampling, not argmax
