"""The process's tensor-parallel group: setup, teardown, and collectives over it.

One process per rank (per GPU under NCCL; gloo on the CPU for tests). The group is the
whole torch.distributed world of the process: data parallel runs separate worlds (one
engine per Ray actor), so a process belongs to one tensor-parallel group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from batchgen.layers.tp_group import SINGLE, TPGroup

_group: TPGroup = SINGLE

# the host messages' gloo group: a worker waits there for rank 0's next message however
# long the LLM idles (torch's default for a new gloo group, 30 minutes, ended idle
# workers); a rank that dies closes its connections, one that goes silent is found by
# the heartbeats (workers.py), not by this timeout
MESSAGE_TIMEOUT_S = 365 * 24 * 3600.0


def init_tensor_parallel(
    rank: int,
    world_size: int,
    backend: str | None = None,
    init_method: str = "env://",
    timeout_s: float = 120.0,
    store: dist.Store | None = None,
    device: int | None = None,
    message_timeout_s: float = MESSAGE_TIMEOUT_S,
) -> TPGroup:
    """Join the group as `rank` of `world_size` and make it the process's group.

    backend: "gloo" (CPU) or "nccl" (CUDA; this process's GPU is `rank` modulo the GPUs
    it sees); None picks nccl where CUDA is available, else gloo. init_method: a
    torch.distributed init method ("tcp://host:port", "file:///path", "env://"), unused
    where `store` (a torch.distributed store every rank reaches) is given. A
    collective waiting on a dead peer raises after `timeout_s` instead of hanging. At
    world_size 1 no process group is created and every collective is a no-op. device:
    this process's GPU under nccl where the launcher chose it (Ray's rank 0), else
    `rank` modulo the GPUs it sees. message_timeout_s: the host messages' gloo group's
    timeout (`TPGroup.host_group`, where an idle worker waits; a year by default)."""
    global _group
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"tensor-parallel rank {rank} is not in [0, {world_size})")
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process")
    if world_size == 1:
        _group = SINGLE
        return _group
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r} (gloo, nccl)")
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count() if device is None else device)
    where = {"store": store} if store is not None else {"init_method": init_method}
    dist.init_process_group(
        backend,
        **where,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    # host messages over gloo whatever the tensors' backend (a gloo world serves both, but
    # every run makes the group, so the CPU tests cover the path NCCL runs)
    messages = dist.new_group(backend="gloo", timeout=timedelta(seconds=message_timeout_s))
    _group = TPGroup(rank, world_size, dist.group.WORLD, messages)
    return _group


def wait_collectives_with(waiter: Callable[[dist.Work], None]) -> TPGroup:
    """Make the process's group wait for its tensors' collectives through `waiter`
    (`TPGroup.waiter`: rank 0's sliced, checked wait under gloo); the group, which the
    models built after this take."""
    global _group
    _group = replace(_group, waiter=waiter)
    return _group


def destroy_tensor_parallel() -> None:
    """Leave the group (if any); the process is single-rank again."""
    global _group
    if dist.is_initialized():
        dist.destroy_process_group()
    _group = SINGLE


def tp_group() -> TPGroup:
    """The process's group (a single-rank one before init_tensor_parallel)."""
    return _group


def tp_rank() -> int:
    return _group.rank


def tp_size() -> int:
    return _group.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the group (in place where x is contiguous); x itself at size 1."""
    return _group.all_reduce(x)


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's x concatenated along dim, rank 0 first; x itself at size 1."""
    return _group.all_gather(x, dim)
