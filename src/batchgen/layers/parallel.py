"""Tensor-parallel layers: each rank holds one slice of a full layer's weight and a
`load(param, tensor, shard)` that cuts its slice from the full checkpoint tensor, so the
loader fills them exactly as it fills `Linear`.

ColumnParallelLinear splits W [out, in] by rows (output features). A stacked layer
splits every shard, so each rank holds its slice of each, in the full layer's order:

    full rows:  | q ............. | k ....... | v ....... |
    rank r:     | q_r | k_r | v_r |     x_r = rows [r * n_x, (r + 1) * n_x) of shard x

RowParallelLinear splits W by columns (input features): rank r multiplies its slice of
x (what a column-parallel layer left on it), one all-reduce sums the partial products,
and the bias is added once, after it.

VocabParallelEmbedding / ParallelLMHead split the vocabulary into `size` ranges of
ceil(vocab / size) rows (the last one padded with zero rows): a lookup outside the
rank's range gives zeros and an all-reduce sums the ranks' rows; logits are gathered
from every rank and trimmed to the vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.layers import batch_invariant
from batchgen.layers.linear import Linear, merged_shards
from batchgen.layers.tp_group import SINGLE, TPGroup


class ColumnParallelLinear(Linear):
    """Output features split across ranks; `shards` are the full layer's row ranges (as
    `Linear` takes them) and each must split evenly, except the `replicated` ones, which
    every rank holds whole (a small projection of the same input that each rank needs in
    full, stacked in to save its own GEMM). With gather_output the full output, in the
    full layer's order, is all-gathered on every rank (no replicated shards then)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        shards: dict[str, tuple[int, int]] | None = None,
        tp: TPGroup = SINGLE,
        gather_output: bool = False,
        replicated: tuple[str, ...] = (),
        quantizable: bool = True,
    ) -> None:
        full = dict(shards or {})
        whole = frozenset(replicated)
        if whole - full.keys():
            raise ValueError(f"replicated shards {sorted(whole - full.keys())} not in {full}")
        if whole and gather_output:
            raise ValueError("gather_output with replicated shards")
        local = {
            name: end - start if name in whole else tp.split(end - start, f"shard {name!r} rows")
            for name, (start, end) in full.items()
        }
        local_out = sum(local.values()) if local else tp.split(out_features, "out_features")
        if local and sum(end - start for start, end in full.values()) != out_features:
            raise ValueError(f"shards {full} do not cover {out_features} rows")
        local_shards = merged_shards(local) if local else None
        super().__init__(in_features, local_out, bias, local_shards, quantizable)
        self.full_shards = full
        self.replicated = whole
        self.tp = tp
        self.full_out_features = out_features
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        return self._gather(y) if self.gather_output else y

    def check_units(self, params) -> None:
        """As Linear's, and each rank's slice of a split shard (of the layer, without
        shards) a whole number of every parameter's row units."""
        super().check_units(params)
        if self.tp.size == 1:
            return
        slices = {
            name: e - s for name, (s, e) in self.shards.items() if name not in self.replicated
        } or {None: self.out_features}
        for name, spec in params.items():
            for shard, rows in slices.items():
                if rows % spec.rows_per:
                    what = "the layer" if shard is None else f"shard {shard!r}"
                    raise ValueError(
                        f"a rank's {rows} rows of {what} are not whole {spec.rows_per}-row "
                        f"units of {name}"
                    )

    def _gather(self, y: torch.Tensor) -> torch.Tensor:
        """Every rank's columns back in the full layer's order (shard by shard)."""
        gathered = self.tp.all_gather(y, dim=-1)
        if self.tp.size == 1 or not self.shards:
            return gathered
        by_rank = gathered.view(*y.shape[:-1], self.tp.size, y.shape[-1])
        return torch.cat([by_rank[..., s:e].flatten(-2) for s, e in self.shards.values()], -1)

    def load(self, param: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        """`tensor` is the full checkpoint tensor: one shard's rows, or the whole layer."""
        per = 1 if self._quantizes(param, tensor) else self.units(param).rows_per
        super().load(param, self._rank_rows(tensor, shard, per), shard)

    def _rank_rows(self, tensor: torch.Tensor, shard: str | None, per: int = 1) -> torch.Tensor:
        """This rank's rows of a full tensor whose rows are units of `per` weight rows:
        a shard's own tensor (its rows cut into units from its first row), or the whole
        layer's (units over the whole weight: every shard must start on one)."""
        if shard is not None:
            start, end = self.full_shards[shard]
            _check_rows(tensor, -(-(end - start) // per), f"shard {shard!r}")
            return self._own_rows(shard, tensor)
        _check_rows(tensor, -(-self.full_out_features // per), "the layer")
        if not self.full_shards:
            return self._own_rows(None, tensor)
        if any(start % per for start, _ in self.full_shards.values()):
            raise ValueError(
                f"a whole-layer tensor in {per}-row units, but a shard starts inside one"
            )
        parts = []
        for name, (start, end) in self.full_shards.items():
            parts.append(self._own_rows(name, tensor[start // per : -(-end // per)]))
        return torch.cat(parts)

    def _own_rows(self, shard: str | None, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows of one shard's full rows (of the whole layer's for None):
        all of a replicated shard, else its equal slice."""
        if shard in self.replicated:
            return rows
        n = rows.shape[0] // self.tp.size
        return rows[self.tp.rank * n : (self.tp.rank + 1) * n]


def _check_rows(tensor: torch.Tensor, rows: int, what: str) -> None:
    if tensor.dim() == 0 or tensor.shape[0] != rows:
        raise ValueError(
            f"{what}: shape {tuple(tensor.shape)} does not have the full tensor's {rows} rows"
        )


class RowParallelLinear(Linear):
    """Input features split across ranks; x is this rank's slice [..., in / size]. The
    output is all-reduced (reduce_output=False leaves partial sums, the bias on rank 0
    only, for a caller that reduces them itself)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        tp: TPGroup = SINGLE,
        reduce_output: bool = True,
        quantizable: bool = True,
    ) -> None:
        local_in = tp.split(in_features, "in_features")
        super().__init__(local_in, out_features, bias, quantizable=quantizable)
        self.tp = tp
        self.full_in_features = in_features
        self.reduce_output = reduce_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.matmul(x, self.bias)
        if not self.reduce_output:
            return self.matmul(x, self.bias if self.tp.rank == 0 else None)
        y = self.tp.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias

    def check_units(self, params) -> None:
        """As Linear's, and each rank's columns a whole number of every parameter's
        column units."""
        super().check_units(params)
        for name, spec in params.items():
            if self.tp.size > 1 and self.in_features % spec.cols_per:
                raise ValueError(
                    f"a rank's {self.in_features} columns are not whole {spec.cols_per}-column "
                    f"units of {name}"
                )

    def load(self, param: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        """`tensor` is the full checkpoint tensor; the weight's columns are cut, the bias
        is whole."""
        if param != "bias":
            per = 1 if self._quantizes(param, tensor) else self.units(param).cols_per
            full, n = -(-self.full_in_features // per), -(-self.in_features // per)
            if tensor.dim() != 2 or tensor.shape[1] != full:
                raise ValueError(f"shape {tuple(tensor.shape)} does not have {full} columns")
            tensor = tensor[:, self.tp.rank * n : (self.tp.rank + 1) * n]
        super().load(param, tensor, shard)


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_end) of the embedding on this rank, in a weight padded
    to ceil(num_embeddings / size) rows (padding rows are zero)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        per_rank = -(-num_embeddings // tp.size)
        self.vocab_start = min(tp.rank * per_rank, num_embeddings)
        self.vocab_end = min(self.vocab_start + per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        rows = F.embedding((ids - self.vocab_start).masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill(outside[..., None], 0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, dim] -> logits [T, num_embeddings] over the whole vocabulary, the
        weight used as an output projection (tied embeddings, or ParallelLMHead)."""
        logits = self.tp.all_gather(batch_invariant.linear(hidden, self.weight), dim=-1)
        if logits.shape[-1] != self.num_embeddings:  # padding rows out, rows contiguous
            logits = logits[..., : self.num_embeddings].contiguous()
        return logits

    def load(self, param: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        """`tensor` is the full [num_embeddings, dim] checkpoint tensor."""
        if param != "weight" or shard is not None:
            raise ValueError(f"unexpected checkpoint parameter {param!r} (weight)")
        expected = (self.num_embeddings, self.weight.shape[1])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"shape {tuple(tensor.shape)} != expected {expected}")
        n = self.vocab_end - self.vocab_start
        with torch.no_grad():
            self.weight[:n].copy_(tensor[self.vocab_start : self.vocab_end])
            self.weight[n:].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection hidden -> logits, vocabulary split as the embedding's."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank's attention reads (its KV pool's num_kv_heads). Every rank
    holds whole KV heads: ValueError naming both numbers unless tp_size divides them
    (replicating KV heads across ranks is not supported)."""
    if num_kv_heads % tp_size:
        raise ValueError(
            f"num_key_value_heads={num_kv_heads} is not divisible by "
            f"tensor_parallel_size={tp_size}: each rank must hold whole KV heads "
            "(replicating KV heads across ranks is not supported); choose a "
            f"tensor_parallel_size that divides {num_kv_heads}"
        )
    return num_kv_heads // tp_size
