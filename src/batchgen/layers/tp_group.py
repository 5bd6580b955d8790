"""A rank's place in its tensor-parallel group, and the collectives layers call on it.

The collectives live here, not in `batchgen.distributed`, because layers sit below that
package (CONTRIBUTING.md's layering): `distributed.init_tensor_parallel` creates the
process group and hands out a `TPGroup`; models pass it down to their parallel layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """Rank `rank` of `size` ranks over `group` (None: torch.distributed's default group),
    the tensors' collectives (NCCL on GPUs); `cpu_group`, the same ranks over gloo, carries
    the host's messages (rank 0's steps as pickled objects) without touching a GPU: an
    object sent over NCCL is staged through device memory, and its receiver waits for its
    GPU to drain before it can read it. None: `group`. At size 1 every collective returns
    its input untouched and needs no process group."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None

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
        """The sum of every rank's x (in place on a contiguous x; returned)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along `dim`, rank 0 first."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = TPGroup()
