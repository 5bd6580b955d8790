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

CUDA graphs: the split sizes are read on the host every step (a sync), so a layer under
expert parallel is not capturable and the engine decodes eagerly (`graph_safe` is False
for it); a padded, fixed-capacity dispatch would lift that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from batchgen.kernels.moe_combine import moe_combine, moe_combine_reference
from batchgen.layers.tp_group import TPGroup


@dataclass(frozen=True)
class ExpertParallel:
    """How a MoE layer spreads its routed experts: over the ranks of `group`, rank r
    holding the r-th block of E / size experts (shared experts replicated).

    local_tokens: each rank's forward gets its own tokens (attention data parallel: a
    rank's own requests; counts may differ, 0 included) and returns their outputs.
    False: every rank gets the same tokens (tensor-parallel attention); rank r then
    runs the r-th slice of ceil(T / size) of them and the slices' outputs are gathered,
    so every rank returns all T rows."""

    group: TPGroup
    local_tokens: bool = False

    @property
    def size(self) -> int:
        return self.group.size

    def forward(
        self, x: torch.Tensor, local: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """local(rows) -> their outputs, on this rank's tokens: x itself where tokens are
        local, else this rank's slice of x with the slices' outputs gathered."""
        if self.local_tokens or self.size == 1:
            return local(x)
        total = x.shape[0]
        chunk = -(-total // self.size)
        start = min(self.group.rank * chunk, total)
        mine = local(x[start : start + chunk])
        padded = mine.new_zeros(chunk, *mine.shape[1:])
        padded[: mine.shape[0]] = mine
        return self.group.all_gather(padded, dim=0)[:total]


def all_to_all(
    x: torch.Tensor, send: list[int], receive: list[int], group: TPGroup
) -> torch.Tensor:
    """Rows x[sum(send[:j]) : sum(send[:j + 1])] to rank j; what every rank sent here, rank
    0's rows first (receive[j] of them from rank j)."""
    out = x.new_empty(sum(receive), *x.shape[1:])
    dist.all_to_all_single(
        out, x.contiguous(), output_split_sizes=receive, input_split_sizes=send, group=group.group
    )
    return out


def dispatch_combine(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    num_experts: int,
    group: TPGroup,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) (+ residual) for this rank's tokens
    x [T, H], the experts spread over `group` (module docstring). experts(rows, weights,
    ids) is this rank's RoutedExperts: rows whose experts are all in its block. Every
    rank of the group calls it for the same layer, whatever its T."""
    tokens, top_k = ids.shape
    size = group.size
    per_rank = num_experts // size
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs by expert, so by owning rank
    counts = torch.bincount(flat, minlength=num_experts)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group.group)
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
    if tokens == 0:
        return back.new_zeros(0, x.shape[1]) if residual is None else residual
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=x.device)
    weights = weights.float().contiguous()
    if x.is_cuda:
        return moe_combine(back, position, weights, residual=residual)
    return moe_combine_reference(back, position, weights, residual)
