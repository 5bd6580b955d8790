"""Expert parallel: a mixture-of-experts layer's routed experts spread over ranks, each
token sent to the ranks of its chosen experts and its expert outputs sent back
(`torch.distributed.all_to_all_single`: NCCL on GPUs, gloo on the CPU).

Rank r of N holds the routed experts [r E / N, (r + 1) E / N) (RoutedExperts' block).
One layer's forward on rank r, over its own T_r tokens (T_r may differ by rank, and
may be 0: the rank still joins every collective):

    route     weights, ids [T_r, k] (the router is replicated)
    sort      the T_r k (token, expert) pairs by expert id: grouped by owning rank
    counts    pairs per expert [E], exchanged (all_to_all of E / N counts per rank):
              what each rank sends and receives, on the host (split sizes are host ints)
    dispatch  the pairs' token rows to their experts' ranks (all_to_all)
    experts   each received row through its one expert (RoutedExperts, weight 1: the
              expert's output in the activations' dtype, as the single-process layer
              has it before weighting)
    combine   the rows back (all_to_all, the reverse splits), each token's k rows
              weighted in float32 and summed in the pairs' order, plus the shared
              experts' output: the single-process layer's arithmetic

The split sizes above are read on the host every step (a sync). Under `fixed_capacity()`
(the decode CUDA graphs' forwards: runner/cuda_graphs.py) the layer dispatches with
fixed shapes instead, no host read, so a graph captures it with its collectives:

    capacity  C tokens a rank (the same on every rank): the slice ceil(T / size) of
              replicated tokens, or for local ones the tokens `fixed_capacity(C)`
              says: the decode bucket the ranks agreed for the forward (runner/
              paired.py; a graph's own bucket where it is captured)
    dispatch  rank r sends every rank j a buffer of C k rows (the worst case: all of
              r's pairs to j's experts), its pairs for j first, the rest zero, and
              beside it each slot's expert id, -1 where empty (all_to_all, equal splits)
    experts   every received slot through its expert, weight 1; an empty slot's id
              -1 is outside the rank's block: RoutedExperts computes nothing for it
    combine   the slots back (all_to_all, equal splits), each pair's row picked from
              its slot, then weighted and summed as above

It moves size x C k rows a rank where the variable path moves the pairs alone: decode
batches only, C the largest rank's bucket, not the most a rank may hold; prefill keeps
the variable path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from batchgen.kernels.moe_combine import moe_combine, moe_combine_reference
from batchgen.layers.tp_group import TPGroup

_FIXED: ContextVar[bool] = ContextVar("expert_parallel_fixed_capacity", default=False)
_CAPACITY: ContextVar[int | None] = ContextVar("expert_parallel_capacity", default=None)


@contextmanager
def fixed_capacity(tokens: int | None = None) -> Iterator[None]:
    """Expert-parallel layers run inside dispatch with fixed-capacity buffers (module
    docstring): no host read, so a CUDA graph can capture the forward. Every rank of a
    group must run the same layer call in the same mode (the decode graphs: every rank
    captures and replays the same buckets). tokens: local tokens' capacity a rank, the
    same on every rank (attention data parallel: the round's agreed decode bucket);
    replicated tokens need none (their slice is the capacity)."""
    fixed, capacity = _FIXED.set(True), _CAPACITY.set(tokens)
    try:
        yield
    finally:
        _CAPACITY.reset(capacity)
        _FIXED.reset(fixed)


@dataclass(frozen=True)
class ExpertParallel:
    """How a MoE layer spreads its routed experts: over the ranks of `group`, rank r
    holding the r-th block of E / size experts (shared experts replicated).

    local_tokens: each rank's forward gets its own tokens (attention data parallel: a
    rank's own requests; counts may differ, 0 included) and returns their outputs.
    False: every rank gets the same tokens (tensor-parallel attention); rank r then
    runs the r-th slice of ceil(T / size) of them and the slices' outputs are gathered,
    so every rank returns all T rows.

    max_tokens: with local_tokens, the largest capacity `fixed_capacity(tokens)` may
    give (the most a rank's decode step holds: max_num_seqs; more is a ValueError); the
    buffers hold the capacity given, the round's bucket, not max_tokens."""

    group: TPGroup
    local_tokens: bool = False
    max_tokens: int | None = None

    @property
    def size(self) -> int:
        return self.group.size

    def forward(
        self, x: torch.Tensor, local: Callable[[torch.Tensor, int | None], torch.Tensor]
    ) -> torch.Tensor:
        """local(rows, capacity) -> their outputs, on this rank's tokens: x itself where
        tokens are local, else this rank's slice of x with the slices' outputs gathered.
        capacity: tokens a rank under `fixed_capacity()` (dispatch_combine's), else None."""
        fixed = _FIXED.get() and self.size > 1
        if self.local_tokens or self.size == 1:
            if not fixed:
                return local(x, None)
            return local(x, self._capacity(x.shape[0]))
        total = x.shape[0]
        chunk = -(-total // self.size)
        start = min(self.group.rank * chunk, total)
        mine = local(x[start : start + chunk], chunk if fixed else None)
        padded = mine.new_zeros(chunk, *mine.shape[1:])
        padded[: mine.shape[0]] = mine
        return self.group.all_gather(padded, dim=0)[:total]

    def _capacity(self, tokens: int) -> int:
        """The fixed-capacity exchange's tokens a rank for `tokens` local ones: what
        `fixed_capacity(capacity)` says, within max_tokens."""
        capacity = _CAPACITY.get()
        if self.max_tokens is None or capacity is None:
            raise ValueError(
                "fixed-capacity dispatch of local tokens needs max_tokens and "
                "fixed_capacity(tokens)"
            )
        if capacity > self.max_tokens:
            raise ValueError(f"capacity {capacity} exceeds max_tokens={self.max_tokens}")
        if tokens > capacity:
            raise ValueError(f"{tokens} tokens on a rank exceed the fixed capacity {capacity}")
        return capacity


def all_to_all(
    x: torch.Tensor, send: list[int], receive: list[int], group: TPGroup
) -> torch.Tensor:
    """Rows x[sum(send[:j]) : sum(send[:j + 1])] to rank j; what every rank sent here, rank
    0's rows first (receive[j] of them from rank j)."""
    out = x.new_empty(sum(receive), *x.shape[1:])
    return group.all_to_all(out, x.contiguous(), receive, send)


def dispatch_combine(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    num_experts: int,
    group: TPGroup,
    residual: torch.Tensor | None = None,
    capacity: int | None = None,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) (+ residual) for this rank's tokens
    x [T, H], the experts spread over `group` (module docstring). experts(rows, weights,
    ids) is this rank's RoutedExperts: rows whose experts are in its block (a pair outside
    it adds nothing: the fixed-capacity dispatch's empty slots, id -1). Every
    rank of the group calls it for the same layer, whatever its T. capacity: the
    fixed-capacity dispatch for at most that many tokens a rank (the same on every
    rank; no host read), else the variable one."""
    top_k = ids.shape[1]
    size = group.size
    per_rank = num_experts // size
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs by expert, so by owning rank
    if capacity is not None:
        back = _fixed_exchange(x, flat, order, top_k, experts, per_rank, group, capacity)
        return _combine(back, order, weights, residual)
    counts = torch.bincount(flat, minlength=num_experts)
    received = torch.empty_like(counts)
    group.all_to_all(received, counts)
    sent_by_rank = counts.view(size, per_rank).sum(1)
    received_by_rank = received.view(size, per_rank).sum(1)
    split = torch.cat((sent_by_rank, received_by_rank)).tolist()  # one host read
    send, receive = split[:size], split[size:]
    rows = all_to_all(x.index_select(0, order // top_k), send, receive, group)
    if rows.shape[0]:
        # the received rows' experts: each source's block counts, in its expert order
        first = group.rank * per_rank
        local = torch.arange(first, first + per_rank, device=x.device).repeat(size)
        expert = torch.repeat_interleave(local, received).unsqueeze(1)
        one = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=x.device)
        rows = experts(rows, one, expert)
    back = all_to_all(rows, receive, send, group)
    return _combine(back, order, weights, residual)


def _fixed_exchange(
    x: torch.Tensor,
    flat: torch.Tensor,
    order: torch.Tensor,
    top_k: int,
    experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    per_rank: int,
    group: TPGroup,
    capacity: int,
) -> torch.Tensor:
    """The expert outputs of this rank's pairs in `order` (dispatch_combine's `back`),
    exchanged through buffers of capacity x top_k slots per rank pair: every shape a
    Python constant, nothing read on the host."""
    size, slots = group.size, capacity * top_k
    if x.shape[0] > capacity:
        raise ValueError(f"{x.shape[0]} tokens exceed the dispatch capacity {capacity}")
    device = x.device
    expert = flat.index_select(0, order)
    owner = torch.div(expert, per_rank, rounding_mode="floor")
    counts = torch.zeros(size, dtype=torch.int64, device=device)
    counts.scatter_add_(0, owner, torch.ones_like(owner))
    starts = torch.cumsum(counts, 0) - counts
    # pair i (sorted) goes to slot i - starts[owner] of its owner's buffer
    slot = owner * slots + torch.arange(order.numel(), device=device) - starts[owner]
    send = x.new_zeros(size * slots, x.shape[1])
    send.index_copy_(0, slot, x.index_select(0, order // top_k))
    send_ids = torch.full((size * slots,), -1, dtype=torch.int64, device=device)
    send_ids.index_copy_(0, slot, expert)
    rows, ids = torch.empty_like(send), torch.empty_like(send_ids)
    group.all_to_all(rows, send)
    group.all_to_all(ids, send_ids)
    filled = (ids >= 0).unsqueeze(1)
    # an empty slot's id -1 is outside this rank's block: RoutedExperts sorts such pairs
    # past every group (no GEMM computes them) and weights them 0; zeroed here besides
    out = experts(rows, filled.to(torch.float32), ids.unsqueeze(1)).masked_fill_(~filled, 0)
    back = torch.empty_like(out)
    group.all_to_all(back, out.contiguous())
    return back.index_select(0, slot)


def _combine(
    back: torch.Tensor,
    order: torch.Tensor,
    weights: torch.Tensor,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """Each token's k expert rows (back: the pairs in `order`) weighted in float32 and
    summed in the pairs' order, plus residual: the one-process layer's arithmetic."""
    if order.numel() == 0:
        return back.new_zeros(0, back.shape[1]) if residual is None else residual
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=back.device)
    weights = weights.float().contiguous()
    if back.is_cuda:
        return moe_combine(back, position, weights, residual=residual)
    return moe_combine_reference(back, position, weights, residual)
