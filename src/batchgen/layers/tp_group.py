"""A rank's place in its tensor-parallel group, and the collectives layers call on it.

The collectives live here, not in `batchgen.distributed`, because layers sit below that
package (CONTRIBUTING.md's layering): `distributed.init_tensor_parallel` creates the
process group and hands out a `TPGroup`; models pass it down to their parallel layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from batchgen.layers import batch_invariant


@dataclass(frozen=True)
class TPGroup:
    """Rank `rank` of `size` ranks over `group` (None: torch.distributed's default group),
    the tensors' collectives (NCCL on GPUs); `cpu_group`, the same ranks over gloo, carries
    the host's messages (rank 0's steps as pickled objects) without touching a GPU: an
    object sent over NCCL is staged through device memory, and its receiver waits for its
    GPU to drain before it can read it. None: `group`. At size 1 every collective returns
    its input untouched and needs no process group.

    `waiter`: how this rank waits for its collectives on `group` (None: torch's blocking
    call). Rank 0 of a gloo group waits in slices, checking between them that no worker
    ended or went silent (distributed.workers), so a forward's collective on a rank whose
    host vanished fails within the heartbeats' bound, not after the group's timeout."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    waiter: Callable[[dist.Work], None] | None = field(default=None, compare=False, repr=False)

    @property
    def host_group(self) -> dist.ProcessGroup | None:
        """The group for host messages (`cpu_group`, else `group`)."""
        return self.group if self.cpu_group is None else self.cpu_group

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")

    def split(self, total: int, what: str) -> int:
        """This rank's equal share of `total` items; ValueError naming `what` unless
        the size divides it."""
        if total % self.size:
            raise ValueError(
                f"{what}={total} is not divisible by the tensor-parallel size {self.size}"
            )
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (in place on a contiguous x; returned).

        In batch-invariant mode (deterministic=True, layers/batch_invariant.py) the sum
        is `rank_order_sum` of the gathered parts: the same bits whatever algorithm or
        topology the collective library picks (NCCL's ring or tree, its channel count,
        gloo's ring: each adds the ranks' parts in an order of its own, which for 3 and
        more ranks changes the rounding). Outside it, the library's all_reduce."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if batch_invariant.active():
            return x.copy_(rank_order_sum(self._gather(x)))
        self._wait(dist.all_reduce(x, group=self.group, async_op=self.waiter is not None))
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along `dim`, rank 0 first."""
        if self.size == 1:
            return x
        return torch.cat(self._gather(x.contiguous()), dim=dim)

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's contiguous x, rank 0 first."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._wait(dist.all_gather(parts, x, group=self.group, async_op=self.waiter is not None))
        return parts

    def all_to_all(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> torch.Tensor:
        """`torch.distributed.all_to_all_single` into `out` (returned): x's rows, split
        by input_split_sizes (None: equal), one part to each rank."""
        work = dist.all_to_all_single(
            out,
            x,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            group=self.group,
            async_op=self.waiter is not None,
        )
        self._wait(work)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """x as rank `src` holds it, on every rank (in place; returned)."""
        if self.size == 1:
            return x
        self._wait(dist.broadcast(x, src=src, group=self.group, async_op=self.waiter is not None))
        return x

    def _wait(self, work: dist.Work | None) -> None:
        """Wait for an asynchronous collective through `waiter` (a blocking one returned
        None: done)."""
        if work is not None:
            self.waiter(work)


def rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """parts[0] + parts[1] + ... added one at a time in list (rank) order, in float32 at
    least (a bfloat16 part is widened exactly, the total rounded once to its dtype): every
    element's bits a function of the parts alone (TPGroup.all_reduce's deterministic sum)."""
    dtype = parts[0].dtype
    total = parts[0].to(torch.promote_types(dtype, torch.float32), copy=True)
    for part in parts[1:]:
        total.add_(part)
    return total.to(dtype)


SINGLE = TPGroup()
