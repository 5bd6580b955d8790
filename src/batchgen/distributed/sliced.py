"""Rank 0's side of the host messages' collectives (workers.Workers.send / gather),
waited on in slices: between slices `check()` raises where a worker ended or went
silent (heartbeat.py). The messages' group waits a year (tensor_parallel.py: a worker
idles there), and a rank whose host vanished closes no connection, so an unsliced wait
on it would last that long.

The framing is torch's object collectives', which the workers still call
(`broadcast_object_list`, `gather_object`): a broadcast of the pickled object's size
(one int64) then of its bytes; for a gather, an all-gather of every rank's size, then a
gather of the bytes, each padded to the largest.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist


def waited(work: dist.Work, check: Callable[[], None], slice_s: float) -> None:
    """Wait for `work`, calling check() every slice_s seconds it is not done (the work
    stays queued: a later wait picks it up)."""
    while True:
        try:
            work.wait(timeout=timedelta(seconds=slice_s))
            return
        except RuntimeError as e:
            if "Operation timed out" not in str(e):
                raise
            check()


def broadcast_object(
    obj: object, group: dist.ProcessGroup, check: Callable[[], None], slice_s: float
) -> None:
    """What `dist.broadcast_object_list([obj], src=0, group)` sends, from rank 0."""
    data = pickle.dumps(obj)
    size = torch.tensor([len(data)], dtype=torch.long)
    waited(dist.broadcast(size, src=0, group=group, async_op=True), check, slice_s)
    body = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    waited(dist.broadcast(body, src=0, group=group, async_op=True), check, slice_s)


def gather_objects(
    group: dist.ProcessGroup, size: int, check: Callable[[], None], slice_s: float
) -> list:
    """Every rank's object of a `dist.gather_object(obj, ..., dst=0, group)`, rank 0's
    own None first."""
    data = pickle.dumps(None)
    sizes = torch.zeros(size, dtype=torch.long)
    size_views = [sizes[i].unsqueeze(0) for i in range(size)]
    mine = torch.tensor([len(data)], dtype=torch.long)
    waited(dist.all_gather(size_views, mine, group=group, async_op=True), check, slice_s)
    longest = int(sizes.max())
    body = torch.zeros(longest, dtype=torch.uint8)
    body[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = torch.empty(longest * size, dtype=torch.uint8)
    parts = [out[longest * r : longest * (r + 1)] for r in range(size)]
    work = dist.gather(body, gather_list=parts, dst=0, group=group, async_op=True)
    waited(work, check, slice_s)
    return [pickle.loads(parts[r][: int(sizes[r])].numpy().tobytes()) for r in range(size)]


def scatter_objects(
    objs: list, group: dist.ProcessGroup, check: Callable[[], None], slice_s: float
) -> None:
    """What `dist.scatter_object_list([None], objs, src=0, group)` sends, from rank 0
    (objs[r] to rank r): the largest pickled size broadcast, the bytes scattered padded
    to it, then each one's size scattered."""
    datas = [pickle.dumps(obj) for obj in objs]
    longest = max(len(data) for data in datas)
    size = torch.tensor([longest], dtype=torch.long)
    waited(dist.broadcast(size, src=0, group=group, async_op=True), check, slice_s)
    bodies = [torch.zeros(longest, dtype=torch.uint8) for _ in datas]
    for body, data in zip(bodies, datas, strict=True):
        body[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = torch.empty(longest, dtype=torch.uint8)
    work = dist.scatter(mine, scatter_list=bodies, src=0, group=group, async_op=True)
    waited(work, check, slice_s)
    sizes = [torch.tensor([len(data)], dtype=torch.long) for data in datas]
    mine_size = torch.zeros(1, dtype=torch.long)
    work = dist.scatter(mine_size, scatter_list=sizes, src=0, group=group, async_op=True)
    waited(work, check, slice_s)
