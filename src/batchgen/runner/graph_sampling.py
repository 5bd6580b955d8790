"""Sampling captured in the decode CUDA graph, after the forward and the logits.

A pure-decode step replays one graph per bucket that runs forward -> logits -> sample
when its rows need nothing a graph cannot hold (`graph_tail` says; the others sample
eagerly after the replay, as before): no logprobs, no min_tokens block, no structured-
output mask, not every row plain greedy (that is an argmax after the forward graph),
top_k at most `MAX_TOP_K`, one tensor-parallel rank, penalties on kept counts. The
step's sampling parameters travel with its graph inputs (one staged copy) into static
words the graph reads, `WIDTH` int64 words a row for bucket bs, each part 16-byte
aligned (Triton compiles a kernel per pointer alignment):

    seeds | positions | top_k | penalty slots | penalised (0/1)      [bi] int64 each
    temperature | top_p | min_p | presence | frequency | repetition [bf] float32 each
    (bi = bs rounded up to even, bf to a multiple of 4; padding rows are greedy)

`sample_static` is the sampler on those words, the same operations `sampler.Sampler`
runs (min_p, top_k and top_p as cuts of the row's logits, the counter-based draw keyed
by seed and position), so the tokens are those of the eager sampler; called eagerly it
is testable on the CPU. A graph variant (`Variant`: min_p used, the top_k taken, the
penalties) is captured for every bucket the first time a step needs it, if it fits:

    graph pool, a row at the largest bucket (`tail_bytes`; variants share the pool,
    so the widest bounds them all):
        logits [V] in the model's dtype | penalised copy [V] float32 (penalties)
        top_k values and int64 indices [top_k] | the nucleus kernel's chunk scratch
    beside it, the kept penalty counts (`counts_bytes`): [V] int32 + [V] bool a slot

The memory plan sets `sampling_graph_reserve` aside for them (engine/builder_plan.py);
a variant whose capture would not fit on the device now samples eagerly, with a
warning the first time (`graph_tail`); one whose warm-up or capture raises samples
eagerly too, the error logged as a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from batchgen.kernels.penalties import penalized_logits, penalized_logits_reference
from batchgen.kernels.sampling import sample_tokens_reference
from batchgen.kernels.sampling_nucleus import sample_nucleus, top_p_cut_reference
from batchgen.runner.penalty_counts import PenaltyCounts
from batchgen.runner.sampling_metadata import StepColumns

logger = logging.getLogger(__name__)

MAX_TOP_K = 1024  # a step whose top_k is larger samples eagerly
_MIN_TOP_K = 64  # the top_k taken: the batch's largest rounded up to a power of 2, >= this
_INTS, _FLOATS = 5, 6
_ROW_BYTES = 256  # a row's small tensors in the tail: cuts, flags, slots, its token
_POOL_SLACK = 64 * 2**20  # the allocator's rounding: 2 MiB blocks, 20 MiB segments


def _strides(bs: int) -> tuple[int, int]:
    return bs + bs % 2, bs + (-bs) % 4


def words_per_bucket(bs: int) -> int:
    """The static int64 words bucket bs reads."""
    bi, bf = _strides(bs)
    return _INTS * bi + _FLOATS * bf // 2


@dataclass(frozen=True)
class Variant:
    """What a captured sampler computes beyond the draw (its graphs' key)."""

    min_p: bool  # the min_p cut (an amax over the vocabulary)
    top_k: int  # the top_k taken for the k-th largest logit (0: no top_k)
    penalties: bool  # the penalty kernel, and the tokens added to the kept counts


WIDEST = Variant(min_p=True, top_k=MAX_TOP_K, penalties=True)  # what any capture holds at most


def tail_bytes(rows: int, vocab: int, dtype: torch.dtype, variant: Variant) -> int:
    """Bytes `sample_static` holds at once for `rows` rows of a `vocab`-wide model whose
    logits are `dtype`: what its graph for bucket `rows` keeps in the graph pool."""
    size = torch.empty(0, dtype=dtype).element_size()
    per_row = vocab * size + _ROW_BYTES + 24 * -(-vocab // 1024)  # nucleus: 24 B a chunk
    if variant.penalties:
        per_row += vocab * 4
    if variant.top_k:
        per_row += variant.top_k * (size + 8)
    return rows * per_row


def counts_bytes(slots: int, vocab: int) -> int:
    """Bytes of `PenaltyCounts` holding `slots` slots (int32 counts and a bool mask)."""
    return slots * vocab * 5


def sampling_graph_reserve(max_bs: int, vocab: int, dtype: torch.dtype) -> int:
    """Device bytes the sampling decode graphs of a runner with `max_bs` rows can hold
    beyond what the memory plan's warm-up steps measure: the widest variant's tail at
    the largest bucket in the graph pool (every variant and bucket shares it), the kept
    penalty counts reserved for `max_bs` requests, and the allocator's rounding."""
    return tail_bytes(max_bs, vocab, dtype, WIDEST) + counts_bytes(max_bs, vocab) + _POOL_SLACK


def variant_of(cols: StepColumns, vocab: int) -> Variant | None:
    """The step's variant, None where it samples eagerly."""
    if cols.min_tokens_block or cols.need_logprobs or cols.all_greedy:
        return None
    if cols.penalised and cols.pen_slots is None:  # counts not kept on the device
        return None
    k = cols.max_top_k
    if k > MAX_TOP_K:
        return None
    top_k = 0 if k == 0 else min(max(_MIN_TOP_K, 1 << (k - 1).bit_length()), vocab)
    return Variant(cols.use_min_p, top_k, bool(cols.penalised))


def pack(cols: StepColumns | None, bs: int) -> np.ndarray:
    """The static words [words_per_bucket(bs)] int64 of a step's rows (None: no row; the
    rest are padding: greedy, no filter, identity penalties on slot 0)."""
    bi, bf = _strides(bs)
    out = np.zeros(words_per_bucket(bs), dtype=np.int64)
    ints = out[: _INTS * bi].reshape(_INTS, bi)
    floats = out[_INTS * bi :].view(np.float32).reshape(_FLOATS, bf)
    floats[1] = floats[5] = 1.0  # top_p, repetition
    if cols is None:
        return out
    n = cols.positions.size
    ints[0, :n], ints[1, :n] = cols.seeds, cols.positions
    ints[2, :n] = cols.floats[3]
    if cols.pen_slots is not None:
        ints[3, :n] = cols.row_slots()
        ints[4, cols.penalised] = 1
    floats[0:3, :n] = cols.floats[0:3]
    floats[3:6, :n] = cols.floats[4:7]
    return out


@dataclass
class StaticColumns:
    """Views [bs] of a bucket's static words (`pack`'s layout) on their device."""

    seeds: torch.Tensor
    positions: torch.Tensor
    top_k: torch.Tensor
    rows: torch.Tensor
    penalised: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor

    @classmethod
    def view(cls, words: torch.Tensor, bs: int) -> StaticColumns:
        bi, bf = _strides(bs)
        ints = words[: _INTS * bi].view(_INTS, bi)[:, :bs]
        floats = words[_INTS * bi : words_per_bucket(bs)].view(torch.float32).view(_FLOATS, bf)
        return cls(*ints.unbind(0), *floats[:, :bs].unbind(0))


def sample_static(
    logits: torch.Tensor,
    cols: StaticColumns,
    variant: Variant,
    kept: PenaltyCounts | None = None,
    kernels: bool = True,
) -> torch.Tensor:
    """Tokens [bs] int64 from logits [bs, V] (not modified) under the static columns, with
    no host read: what `Sampler()(logits, meta)` draws for the same rows (``kernels``: the
    Triton kernels, else their torch references). ``variant.penalties``: the rows read
    ``kept``'s counts at their slots, and the penalised rows' tokens are added there."""
    x = logits
    if variant.penalties:
        args = (kept.counts, kept.prompt, cols.repetition, cols.frequency, cols.presence)
        if kernels:
            x = penalized_logits(x.contiguous(), *args, cols.rows)
        else:
            x = penalized_logits_reference(x, *args, cols.rows)
    x = x.contiguous()
    neg_inf = float("-inf")
    cut = torch.full_like(cols.temperature, neg_inf)
    if variant.min_p:  # as sampler.filter_cut
        floor = x.amax(dim=1).float() + cols.temperature * torch.log(cols.min_p)
        cut = torch.where(cols.min_p > 0, floor, neg_inf)
    if variant.top_k:
        k = cols.top_k
        largest = x.topk(variant.top_k, dim=1).values
        kth = largest.gather(1, (k - 1).clamp(min=0).unsqueeze(1)).squeeze(1).float()
        cut = torch.maximum(cut, torch.where(k > 0, kth, neg_inf))
    args = (x, cols.temperature, cols.seeds, cols.positions)
    if kernels:
        tokens = sample_nucleus(*args, cols.top_p, cut)
    else:
        nucleus = top_p_cut_reference(x, cols.temperature, cols.top_p, cut)
        tokens = sample_tokens_reference(*args, nucleus)
    if variant.penalties:  # as SamplingMetadata.record, for the penalised rows only
        vocab = x.shape[1]
        flat = cols.rows * vocab + tokens.clamp(0, vocab - 1)
        kept.counts.view(-1).scatter_add_(0, flat, cols.penalised.to(torch.int32))
    return tokens


class GraphTail:
    """What a decode graph runs after its forward for one step (`DecodeGraphs.run(...,
    tail=)`): the logits and `sample_static`; `tokens` holds the step's tokens after
    the replay."""

    def __init__(self, model, cols: StepColumns, variant: Variant, kept: PenaltyCounts):
        self.model, self.cols, self.variant, self.kept = model, cols, variant, kept
        self.tokens: torch.Tensor | None = None

    @property
    def key(self) -> tuple:
        """The graphs' key: the variant and, with penalties, the counts' address and
        size, which the graphs bake in (new graphs once they grow)."""
        kept = self.kept
        pen = (kept.counts.data_ptr(), kept.prompt.data_ptr(), len(kept.counts))
        return (self.variant, pen if self.variant.penalties else None)

    words_per_bucket = staticmethod(words_per_bucket)

    def pool_bytes(self, rows: int, dtype: torch.dtype) -> int:
        """What this tail's graph for bucket `rows` holds in the graph pool."""
        return tail_bytes(rows, self.kept.vocab_size, dtype, self.variant)

    def words(self, bs: int, rows: bool = True) -> np.ndarray:
        """The static words of bucket bs: this step's rows, or (rows=False) none."""
        return pack(self.cols if rows else None, bs)

    def compute(self, hidden: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        cols = StaticColumns.view(words, hidden.shape[0])
        logits = self.model.compute_logits(hidden)
        return sample_static(logits, cols, self.variant, self.kept)

    def finish(self, flight) -> None:
        """Hand the replayed step's tokens to its InFlightDecode (queued for the host)."""
        if self.variant.penalties:
            self.kept.counted(self.cols.pen_ids)
        flight.tokens = self.tokens
        flight.copy_tokens(self.tokens)


def graph_tail(runner, flight, steps: list[int]) -> GraphTail | None:
    """The tail a decode step (its InFlightDecode: every row samples, graph-able) replays
    with, None where it samples after the replay: no graphs, a structured-output grammar
    following a request, more than one tensor-parallel rank, an attention data-parallel
    rank (its tails' captures, one rank's sampling alone, would run forwards the other
    ranks do not pair: runner/paired.py), every row plain greedy, or what `variant_of`
    leaves eager."""
    model, grammar = runner.model, runner.grammar
    if runner.graphs is None or runner.sampler.kernels is False or runner.pairing is not None:
        return None
    if grammar is not None and grammar.following:
        return None
    tp = getattr(model, "tp", None)
    if tp is not None and tp.size > 1:  # workers compute the logits' gather eagerly
        return None
    if flight.plain_greedy():
        return None
    cols = runner.sampling.columns_for(flight.sampled, steps)
    variant = variant_of(cols, runner.vocab_size)
    if variant is None:
        return None
    tail = GraphTail(model, cols, variant, runner.penalties)
    return tail if _captured(runner.graphs, tail) else None


def _captured(graphs, tail: GraphTail) -> bool:
    """Whether `graphs` hold the tail's graphs, capturing them first where they fit (see
    `DecodeGraphs.tail_room`); a variant that does not fit samples eagerly from then on
    (until the pool is re-created), with a warning the first time."""
    if graphs.has_tail(tail.key):
        return True
    variant, kept, max_bs = tail.variant, tail.kept, graphs.max_bs
    if variant in graphs.refused_tails:
        return False
    # every row the graphs may hold gets a count slot now: one capture, not one a growth;
    # the growth holds the old counts and the new at once
    grow = variant.penalties and len(kept.counts) < max_bs
    need = tail.pool_bytes(max_bs, graphs.dtype)
    if graphs.tail_room(need, counts_bytes(max_bs, kept.vocab_size) if grow else 0):
        if grow:
            kept.reserve(max_bs)
        try:
            if graphs.capture_tail(tail):
                return True
        except Exception:  # the sampler after the replay is the path that stays whole
            graphs.refused_tails.add(variant)
            logger.warning(
                "capturing decode graphs with sampling %s failed: those steps sample "
                "after the replay instead",
                variant,
                exc_info=True,
            )
            return False
    graphs.refused_tails.add(variant)
    if not graphs.warned_tails:
        graphs.warned_tails = True
        logger.warning(
            "decode graphs with sampling %s do not fit on the device (%.0f MiB at %d rows): "
            "those steps sample after the replay instead; a smaller max_num_seqs, "
            "num_kv_pages or gpu_memory_utilization leaves room for them",
            variant,
            need / 2**20,
            max_bs,
        )
    return False
