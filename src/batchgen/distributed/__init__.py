"""Tensor parallel: the process group and collectives over it (tensor_parallel.py), the
workers' processes (workers.py; started by a launcher, launchers.py: on this host, or as
Ray actors over a cluster's hosts, ray_ranks.py) and rank 0's messages to them
(messages.py)."""

from batchgen.distributed.tensor_parallel import (
    all_gather,
    all_reduce,
    destroy_tensor_parallel,
    init_tensor_parallel,
    tp_group,
    tp_rank,
    tp_size,
)

__all__ = [
    "all_gather",
    "all_reduce",
    "destroy_tensor_parallel",
    "init_tensor_parallel",
    "tp_group",
    "tp_rank",
    "tp_size",
]
