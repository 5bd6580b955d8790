"""Turn one step's logits into next tokens, vLLM v1 style, without host synchronisation.

Per step the runner calls ``SamplingMetadata.build`` (host lists -> device tensors) and then
``Sampler()(logits, meta)``. Processing order, as in vLLM v1::

    raw logits --log_softmax--> logprobs, ranks, top-k logprobs (what is reported)
        |
        +-> min_tokens block -> penalties (repetition, frequency, presence)
              +-> argmax                                        (greedy rows)
              +-> cut: min_p -> top_k -> top_p, each a threshold on the row's logits
                    -> argmax(x / T + Gumbel) over x >= cut         (sampled rows)

The last line is one launch for the whole batch (`kernels.sampling.sample_tokens`; on
the CPU its torch reference, the same noise): greedy rows take the argmax there too, and
the sample is an exact draw from softmax(x / T) renormalised over the kept tokens.

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
from batchgen.kernels.sampling import sample_tokens, sample_tokens_reference
from batchgen.kernels.sampling_cut import top_p_cut, top_p_cut_reference
from batchgen.runner.penalty_counts import PenaltyCounts, token_stats
from batchgen.sampling_params import SamplingParams

# Temperatures below this are greedy, as in vLLM (dividing by them would overflow).
SAMPLING_EPS = 1e-5
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _as_int64(seed: int) -> int:
    """A seed as the int64 whose bits are seed mod 2^64 (what the noise hash reads)."""
    seed &= _MASK64
    return seed - (1 << 64) if seed >> 63 else seed


def request_seed(engine_seed: int, index: int) -> int:
    """Seed of the ``index``-th request an engine seeded with ``engine_seed`` takes that has
    no seed of its own: a 63-bit mix of both, apart from the seeds users give (it is
    derived once per request; the noise hash then mixes in the step)."""
    return _splitmix64(_splitmix64((engine_seed & _MASK64) ^ 0x5EED5EED5EED5EED) ^ index) >> 1


@dataclass
class SamplingMetadata:
    """Per-step sampling state of a batch of B rows (those of the logits), on their device.

    The ``use_*`` flags are host-side hints set by ``build`` so that unused filters cost
    nothing; leaving them True is always correct."""

    temperature: torch.Tensor  # [B] float32, 0.0 = greedy row
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = disabled
    min_p: torch.Tensor  # [B] float32
    all_greedy: bool
    seeds: torch.Tensor  # [B] int64: each row's noise seed (two's complement of seed mod 2^64)
    positions: torch.Tensor  # [B] int64: each row's tokens generated so far (the noise step)
    max_logprobs: int  # max over rows of params.logprobs (0 if none asked)
    presence_penalty: torch.Tensor | None  # [B]; the penalty fields are None when no row
    frequency_penalty: torch.Tensor | None  # [B]  of the batch uses any penalty
    repetition_penalty: torch.Tensor | None  # [B]
    output_token_counts: torch.Tensor | None  # [B, V] int32 counts of the row's output tokens
    prompt_token_mask: torch.Tensor | None  # [B, V] bool: token appears in the row's prompt
    min_tokens_block: list[tuple[int, list[int]]]  # (row, ids to forbid) under min_tokens
    max_top_k: int = 0  # the largest top_k of the batch (the topk taken for all rows)
    use_top_k: bool = True
    use_top_p: bool = True
    use_min_p: bool = True
    need_logprobs: bool = True  # False: no row reports logprobs (the output's are None)
    # kept penalty counts: (penalised rows [P], their slots [P], the PenaltyCounts, ids)
    penalty_rows: tuple[torch.Tensor, torch.Tensor, PenaltyCounts, list[str]] | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
        eos_token_ids: list[int],
        steps: list[int] | None = None,
        seeds: list[int | None] | None = None,
        generator: torch.Generator | None = None,
        penalty_counts: PenaltyCounts | None = None,
        request_ids: list[str] | None = None,
    ) -> SamplingMetadata:
        """Gather the batch's parameters into tensors on ``device``.

        ``output_token_ids[i]`` is what row i has generated so far: its length is the step
        index used for seeded noise and for ``min_tokens``, unless ``steps`` gives it
        (a pipelined step: tokens sampled but not yet on the host count). ``seeds``, when
        given, replaces each row's ``params.seed`` (the engine's per-request seeds); a
        sampled row with no seed gets one drawn from ``generator`` (a CPU generator;
        None: torch's default one). Prompt and output token ids are only read for rows
        that use a penalty: with ``penalty_counts`` (and ``request_ids``), only for a
        request it does not hold yet; the counts are then its rows on the device, and
        ``record`` adds the step's tokens to them.
        """
        device = torch.device(device)
        n = len(params)
        greedy = [p.temperature < SAMPLING_EPS for p in params]
        penalised = [i for i, p in enumerate(params) if p.has_penalties]
        # One float32 [width, B] tensor crosses to the device: temperature, top_p, min_p,
        # top_k, then the presence, frequency and repetition penalties if any row uses one.
        rows = [
            (0.0, 1.0, 0.0, 0)
            if g
            else (p.temperature, p.top_p, p.min_p, p.top_k if 0 < p.top_k < vocab_size else 0)
            for p, g in zip(params, greedy)
        ]
        width = 7 if penalised else 4
        if penalised:
            rows = [
                r + (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
                for r, p in zip(rows, params)
            ]
        packed = torch.tensor(rows, dtype=torch.float32).view(n, width).t().contiguous()
        packed = to_device(packed, device)
        positions: list[int] = []
        row_seeds: list[int | None] = []
        min_tokens_block: list[tuple[int, list[int]]] = []
        for i, p in enumerate(params):
            step = len(output_token_ids[i]) if steps is None else steps[i]
            positions.append(step)
            row_seeds.append(p.seed if seeds is None else seeds[i])
            if step < p.min_tokens:
                ids = ([] if p.ignore_eos else list(eos_token_ids)) + list(p.stop_token_ids)
                ids = sorted({t for t in ids if 0 <= t < vocab_size})
                if ids:
                    min_tokens_block.append((i, ids))
        unseeded = [i for i, s in enumerate(row_seeds) if s is None and not greedy[i]]
        if unseeded:
            drawn = torch.randint(0, 2**62, (len(unseeded),), generator=generator).tolist()
            for i, s in zip(unseeded, drawn):
                row_seeds[i] = s
        # One int64 tensor crosses too: seeds, positions, then (penalties kept on the
        # device) each row's slot, the penalised rows and their slots.
        ints = [_as_int64(s or 0) for s in row_seeds] + positions
        slots = None
        if penalised and penalty_counts is not None:
            slots = penalty_counts.slots(
                [request_ids[i] for i in penalised],
                [prompt_token_ids[i] for i in penalised],
                [output_token_ids[i] for i in penalised],
                [positions[i] for i in penalised],
            )
            of_row = dict(zip(penalised, slots))
            ints += [of_row.get(i, slots[0]) for i in range(n)] + penalised + slots
        ints = to_device(torch.tensor(ints, dtype=torch.int64), device)
        presence = frequency = repetition = counts = prompt_mask = None
        penalty_rows = None
        if penalised:
            presence, frequency, repetition = packed[4], packed[5], packed[6]
        if slots is not None:
            m = len(penalised)
            row_slots = ints[2 * n : 3 * n]
            counts = penalty_counts.counts.index_select(0, row_slots)
            prompt_mask = penalty_counts.prompt.index_select(0, row_slots)
            penalty_rows = (
                ints[3 * n : 3 * n + m],
                ints[3 * n + m :],
                penalty_counts,
                [request_ids[i] for i in penalised],
            )
        elif penalised:
            outs = [(i, output_token_ids[i]) for i in penalised]
            rep = [(i, prompt_token_ids[i]) for i in penalised if params[i].repetition_penalty != 1]
            counts, prompt_mask = token_stats(n, vocab_size, device, outs, rep)
        return cls(
            temperature=packed[0],
            top_p=packed[1],
            top_k=packed[3].to(torch.int64),
            min_p=packed[2],
            all_greedy=all(greedy),
            seeds=ints[:n],
            positions=ints[n : 2 * n],
            max_logprobs=max((p.logprobs or 0 for p in params), default=0),
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            output_token_counts=counts,
            prompt_token_mask=prompt_mask,
            min_tokens_block=min_tokens_block,
            max_top_k=max((int(r[3]) for r in rows), default=0),
            use_top_k=any(r[3] > 0 for r in rows),
            use_top_p=any(r[1] < 1.0 for r in rows),
            use_min_p=any(r[2] > 0.0 for r in rows),
            need_logprobs=any(p.logprobs is not None for p in params),
            penalty_rows=penalty_rows,
        )

    def record(self, token_ids: torch.Tensor) -> None:
        """Count this step's sampled tokens [B] (on the device) in the penalised rows'
        kept counts, if they are kept (``build(..., penalty_counts=)``)."""
        if self.penalty_rows is not None:
            rows, slots, kept, request_ids = self.penalty_rows
            kept.record(request_ids, slots, token_ids.index_select(0, rows))


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


def apply_min_tokens(logits: torch.Tensor, block: list[tuple[int, list[int]]]) -> torch.Tensor:
    """Return ``logits`` (not modified) with each blocked (row, token) set to -inf."""
    if not block:
        return logits
    rows = [r for r, ids in block for _ in ids]
    cols = [t for _, ids in block for t in ids]
    index = to_device(torch.tensor([rows, cols], dtype=torch.int64), logits.device)
    neg_inf = logits.new_full((1,), float("-inf"))
    return logits.index_put((index[0], index[1]), neg_inf)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Return ``logits`` (not modified) with the repetition, frequency and presence penalties.

    Repetition (prompt and output tokens): positive logits are divided by it, the others
    multiplied. Frequency subtracts penalty * count; presence subtracts penalty once.
    """
    counts = meta.output_token_counts
    if counts is None or meta.repetition_penalty is None:
        return logits
    seen = counts > 0
    if meta.prompt_token_mask is not None:
        seen = seen | meta.prompt_token_mask
    rep = torch.where(seen, meta.repetition_penalty.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    if meta.frequency_penalty is not None:
        logits = logits - meta.frequency_penalty.unsqueeze(1) * counts
    if meta.presence_penalty is not None:
        logits = logits - meta.presence_penalty.unsqueeze(1) * (counts > 0)
    return logits


def filter_cut(x: torch.Tensor, meta: SamplingMetadata, kernels: bool) -> torch.Tensor | None:
    """Each row's cut [B] float32 on the logits ``x``: a sampled row keeps the tokens with
    x >= cut, which is min_p, then top_k, then top_p applied to softmax(x / T) and
    renormalised (None: no row filters). Every filter is a threshold on the row's
    logits, so no vocabulary is sorted:

    - min_p: p(token) < min_p * p(top) is x < max(x) + T * log(min_p);
    - top_k: the k-th largest logit (torch.topk of the batch's largest k), ties kept;
    - top_p: the nucleus of what the two above keep (`kernels.sampling_cut`, a
      bisection; on the CPU its sort-based reference), ties at its edge kept.
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
    if meta.use_top_p:
        if cut is None:
            cut = torch.full_like(meta.temperature, neg_inf)
        nucleus = top_p_cut if kernels else top_p_cut_reference
        cut = nucleus(x, meta.temperature, meta.top_p, cut)
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
        if meta.min_tokens_block or meta.repetition_penalty is not None:
            x = apply_penalties(apply_min_tokens(x.float(), meta.min_tokens_block), meta)
        if meta.all_greedy:
            token_ids = x.argmax(dim=-1)
        else:
            kernels = x.is_cuda if self.kernels is None else self.kernels
            x = x.contiguous()
            cut = filter_cut(x, meta, kernels)
            draw = sample_tokens if kernels else sample_tokens_reference
            token_ids = draw(x, meta.temperature, meta.seeds, meta.positions, cut)
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
