"""Turn one step's logits into next tokens, vLLM v1 style, without host synchronisation.

Per step the runner calls ``SamplingState.build`` (sampling_metadata.py: the running
requests' parameters, kept by request id, gathered into device tensors) and then
``Sampler()(logits, meta)``. Processing order, as in vLLM v1::

    raw logits --log_softmax--> logprobs, ranks, top-k logprobs (what is reported)
        |
        +-> penalties (repetition, frequency, presence; one kernel) -> min_tokens block
              +-> argmax                                        (greedy rows)
              +-> cut: min_p -> top_k -> top_p, each a threshold on the row's logits
                    -> argmax(x / T + Gumbel) over x >= cut         (sampled rows)

The last line is one launch for the whole batch (`kernels.sampling.sample_tokens`; on
the CPU its torch reference, the same noise): greedy rows take the argmax there too, and
the sample is an exact draw from softmax(x / T) renormalised over the kept tokens. With
top_p, on the GPU, the cut stops at top_k/min_p and `kernels.sampling_nucleus` draws
first and checks the draw against the nucleus (the same token, the cut never computed).

Invariant: the noise of a row is a counter-based hash of (its seed, its position = the
tokens it has generated so far, the token id), computed on the device from tensors:
never from the other rows of the batch, the row's place in it, a generator's state, or a
step a pipelined decode discards. The engine gives every request a seed (its own, or
`request_seed(engine seed, arrival index)`); a row built without one gets a seed drawn
on the host (``SamplingMetadata.build(..., generator=)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.forward_context import to_device
from batchgen.kernels.penalties import penalized_logits, penalized_logits_reference
from batchgen.kernels.sampling import sample_tokens, sample_tokens_reference
from batchgen.kernels.sampling_nucleus import sample_nucleus, top_p_cut_reference
from batchgen.runner.penalty_counts import PenaltyCounts
from batchgen.runner.sampling_metadata import (
    SAMPLING_EPS,
    SamplingMetadata,
    SamplingState,
    request_seed,
)
from batchgen.sampling_params import SamplingParams

# the step's metadata lives in sampling_metadata.py; these names are imported from here too
__all__ = [
    "SAMPLING_EPS",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingState",
    "apply_min_tokens",
    "apply_penalties",
    "apply_token_bitmask",
    "check_finite",
    "filter_cut",
    "request_seed",
    "warm_kernels",
]


@dataclass
class SamplerOutput:
    """One step's result; every tensor is on the logits' device, rows as in the batch."""

    sampled_token_ids: torch.Tensor  # [B] int64
    sampled_logprobs: torch.Tensor | None  # [B] float32, raw logprob of the sampled token
    sampled_ranks: torch.Tensor | None  # [B] int64, 1-based rank of it in the raw distribution
    topk_token_ids: torch.Tensor | None  # [B, max_logprobs] int64 (None when max_logprobs == 0)
    topk_logprobs: torch.Tensor | None  # [B, max_logprobs] float32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set to -inf, in place, the logits [B, V] of the tokens each row's packed mask
    [B, W] int32 forbids (bit j of word i allows token 32 * i + j; structured outputs).
    Elementwise on the device, nothing read back."""
    rows, vocab = logits.shape
    octets = bitmask.contiguous().view(torch.uint8)  # little-endian: octet k, tokens 8k..8k+7
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    allowed = ((octets.unsqueeze(-1) >> shifts) & 1).view(rows, -1)[:, :vocab]
    return logits.masked_fill_(allowed == 0, float("-inf"))


def check_finite(logits: torch.Tensor, sampled) -> None:
    """FloatingPointError naming the rows of `sampled` (their `request_id`) whose logits
    [B, V] hold a NaN or an infinity (batchgen_debug's check; it reads the device)."""
    bad = (~torch.isfinite(logits)).any(dim=-1)
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise FloatingPointError(
            "non-finite logits for request(s) " + ", ".join(sampled[i].request_id for i in rows)
        )


def apply_min_tokens(logits: torch.Tensor, block: list[tuple[int, list[int]]]) -> torch.Tensor:
    """Return ``logits`` (not modified) with each blocked (row, token) set to -inf."""
    if not block:
        return logits
    rows = [r for r, ids in block for _ in ids]
    cols = [t for _, ids in block for t in ids]
    index = to_device(torch.tensor([rows, cols], dtype=torch.int64), logits.device)
    neg_inf = logits.new_full((1,), float("-inf"))
    return logits.index_put((index[0], index[1]), neg_inf)


def apply_penalties(
    logits: torch.Tensor, meta: SamplingMetadata, kernels: bool = False
) -> torch.Tensor:
    """Return ``logits`` (not modified) with the repetition, frequency and presence penalties
    (float32; ``kernels``: in one pass, `kernels.penalties`, else op by op in torch).

    Repetition (prompt and output tokens): positive logits are divided by it, the others
    multiplied. Frequency subtracts penalty * count; presence subtracts penalty once.
    """
    if meta.penalty_source is None or meta.repetition_penalty is None:
        return logits
    counts, prompt_mask, rows = meta.penalty_source  # kept counts: read at their slots
    penalties = (meta.repetition_penalty, meta.frequency_penalty, meta.presence_penalty)
    if kernels and None not in penalties:
        return penalized_logits(logits.contiguous(), counts, prompt_mask, *penalties, rows)
    return penalized_logits_reference(logits, counts, prompt_mask, *penalties, rows)


def filter_cut(x: torch.Tensor, meta: SamplingMetadata, top_p: bool = True) -> torch.Tensor | None:
    """Each row's cut [B] float32 on the logits ``x``: a sampled row keeps the tokens with
    x >= cut, which is min_p, then top_k, then (``top_p``) top_p applied to softmax(x / T)
    and renormalised (None: no row filters). Every filter is a threshold on the row's
    logits; only top_p sorts, and the sampler asks for it off CUDA alone:

    - min_p: p(token) < min_p * p(top) is x < max(x) + T * log(min_p);
    - top_k: the k-th largest logit (torch.topk of the batch's largest k), ties kept;
    - top_p: the nucleus of what the two above keep (`top_p_cut_reference`, a sort;
      the sampler's kernel path draws without it, `sample_nucleus`), ties at its edge kept.
    """
    cut = None
    neg_inf = float("-inf")
    if meta.use_min_p:
        top = x.amax(dim=1).float()
        floor = top + meta.temperature * torch.log(meta.min_p)  # NaN where min_p is 0
        cut = torch.where(meta.min_p > 0, floor, neg_inf)
    if meta.use_top_k:
        k = meta.top_k
        largest = x.topk(meta.max_top_k, dim=1).values
        kth = largest.gather(1, (k - 1).clamp(min=0).unsqueeze(1)).squeeze(1).float()
        kth = torch.where(k > 0, kth, neg_inf)
        cut = kth if cut is None else torch.maximum(cut, kth)
    if meta.use_top_p and top_p:
        if cut is None:
            cut = torch.full_like(meta.temperature, neg_inf)
        cut = top_p_cut_reference(x, meta.temperature, meta.top_p, cut)
    return cut


class Sampler:
    """Samples one token per row; issues no host synchronisation.

    ``generator`` (a CPU generator) draws the seeds of sampled rows that come without
    one (the engine seeds every request; callers pass it to ``SamplingMetadata.build``).
    ``kernels``: sample with the Triton kernels (None: on CUDA devices; elsewhere their
    torch references, which draw the same noise)."""

    def __init__(
        self, generator: torch.Generator | None = None, kernels: bool | None = None
    ) -> None:
        self.generator = generator
        self.kernels = kernels

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample from ``logits`` [B, V] (not modified) under ``meta``."""
        x = logits
        kernels = x.is_cuda if self.kernels is None else self.kernels
        if meta.repetition_penalty is not None:  # then min_tokens: a -inf stays -inf
            x = apply_penalties(x, meta, kernels)
        if meta.min_tokens_block:
            x = apply_min_tokens(x.float(), meta.min_tokens_block)
        if meta.all_greedy:
            token_ids = x.argmax(dim=-1)
        else:
            x = x.contiguous()
            args = (x, meta.temperature, meta.seeds, meta.positions)
            if kernels and meta.use_top_p:  # draw, then check the draw against top_p
                token_ids = sample_nucleus(*args, meta.top_p, filter_cut(x, meta, top_p=False))
            else:
                draw = sample_tokens if kernels else sample_tokens_reference
                token_ids = draw(*args, filter_cut(x, meta))
        if not meta.need_logprobs:  # the full-vocabulary log_softmax is skipped
            return SamplerOutput(token_ids, None, None, None, None)
        raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        return _gather_logprobs(raw_logprobs, token_ids, meta.max_logprobs)


def _gather_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, k: int) -> SamplerOutput:
    sampled = raw.gather(1, token_ids.unsqueeze(1))
    ranks = (raw >= sampled).sum(dim=-1)
    topk_ids = topk_lp = None
    if k > 0:
        topk_lp, topk_ids = raw.topk(k, dim=-1)
    return SamplerOutput(token_ids, sampled.squeeze(1), ranks, topk_ids, topk_lp)


# what warm_kernels samples with: top_p with and without an earlier cut, a plain draw with
# and without one, and the penalty kernel with and without prompt tokens
_WARM_PARAMS = (
    dict(temperature=0.8, top_p=0.95),
    dict(temperature=0.8, top_p=0.95, top_k=5),
    dict(temperature=0.8),
    dict(temperature=0.8, min_p=0.1),
    dict(temperature=0.8, repetition_penalty=1.1),
    dict(temperature=0.8, frequency_penalty=0.1),
)


def warm_kernels(
    sampler: Sampler, vocab_size: int, dtype: torch.dtype, device: torch.device
) -> None:
    """Sample two rows of zero logits [2, vocab_size] of ``dtype`` once under each kind of
    step (`_WARM_PARAMS`), with a state and penalty counts of their own: Triton compiles
    each kernel variant a sampled step launches here, at build time, instead of in the
    first sampled steps of a job (0.3-2 s of host time each, while the GPU drains)."""
    logits = torch.zeros(2, vocab_size, dtype=dtype, device=device)
    for kw in _WARM_PARAMS:
        params = [SamplingParams(seed=1, **kw), SamplingParams(seed=2, **kw)]
        state = SamplingState(vocab_size, device, [], None, PenaltyCounts(vocab_size, device))
        meta = state.build(["a", "b"], params, [[0], [0]], [[0], [0]])
        meta.record(sampler(logits, meta).sampled_token_ids)
