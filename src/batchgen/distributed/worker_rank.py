"""A worker rank's side of a group (workers.py is rank 0's): worker_main connects to rank
0's store and says so, beats (heartbeat.py), joins the group, runs its target (serve:
rank 0's messages until Shutdown) and leaves the group, its heartbeat thread stopped
first. Where the target raised, the process ends through the interpreter's teardown
(launchers.run_then_exit skips it after a return only), which a daemon thread still
inside a store call would abort ("terminate called without an active exception").
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from batchgen.distributed.heartbeat import start_beating
from batchgen.distributed.messages import DPMessage, Message, Shutdown
from batchgen.distributed.tensor_parallel import destroy_tensor_parallel, init_tensor_parallel
from batchgen.layers.tp_group import TPGroup

logger = logging.getLogger(__name__)

# how long a worker that leaves waits for its heartbeat thread (a store call in flight)
BEAT_JOIN_S = 10.0


def joined_key(rank: int) -> str:
    return f"batchgen/joined/{rank}"


def serve(tp: TPGroup, handle: Callable[[Message | DPMessage], object]) -> None:
    """A worker's loop: each message rank 0 sends goes to `handle`, whose answer is
    gathered to rank 0 where the message `replies`, until Shutdown."""
    while not isinstance(message := receive(tp), Shutdown):
        reply = handle(message)
        if message.replies:
            dist.gather_object(reply, None, dst=0, group=tp.host_group)


def receive_scattered(tp: TPGroup):
    """This worker's item of what rank 0 scatters (Workers.scatter)."""
    box = [None]
    dist.scatter_object_list(box, None, src=0, group=tp.host_group)
    return pickle.loads(box[0])


def receive(tp: TPGroup) -> Message | DPMessage:
    """The next message rank 0 broadcasts."""
    box = [None]
    dist.broadcast_object_list(box, src=0, group=tp.host_group)
    return pickle.loads(box[0])


def worker_main(
    rank, size, host, port, backend, timeouts, beats, target, args, device=None
) -> None:
    """A worker rank (a process or an actor): connect to rank 0's store at host:port and
    say so, beat (heartbeat.py: `beats` is (period, silence bound)), join the group (on
    GPU `device` where the launcher chose it; `timeouts`: the group's and the messages'),
    run target(tp, *args), leave."""
    torch.set_num_threads(max(1, torch.get_num_threads() // size))  # the host's cores shared
    timeout_s, message_timeout_s = timeouts
    store = dist.TCPStore(host, port, size, is_master=False, timeout=timedelta(seconds=timeout_s))
    stop_beating = start_beating(host, port, rank, *beats)
    store.set(joined_key(rank), "1")
    tp = init_tensor_parallel(
        rank,
        size,
        backend,
        timeout_s=timeout_s,
        store=store,
        device=device,
        message_timeout_s=message_timeout_s,
    )
    try:
        target(tp, *args)
    except BaseException:
        # rank 0 gone (its messages' connection reset) or this rank failed: a collective
        # it queued (a replayed graph's) may wait forever on rank 0, and leaving the
        # group would wait for it, holding this GPU; an abort ends it
        if backend == "nccl":
            abort_collectives(tp)
        raise
    finally:
        try:
            stop_beating(BEAT_JOIN_S)  # where this rank fails, its process tears down
        finally:
            destroy_tensor_parallel()


def abort_collectives(tp: TPGroup) -> None:
    """End every NCCL collective in flight on this rank's tensors' group (a replayed
    graph's too: NCCL's watchdog does not time those out). Logged if it fails."""
    try:
        tp.group.abort()
    except Exception:
        logger.exception("aborting the tensor-parallel NCCL group failed")
