"""What a launcher gives Workers (workers.py) for ranks 1..N-1 of a group, wherever it
runs them: processes of this host (launchers.ProcessRanks, "mp") or Ray actors over a
cluster's hosts (ray_ranks.RayRanks, "ray"; vLLM's distributed_executor_backend).

    RankSet: host, local_device, grace_s        the launcher's side of one group
      start(entry, args)   rank r runs entry(*args[r]) in its own process or actor
      wait(ranks, timeout) the ranks among them that ended, with their status
      describe(ended)      those ranks named, with where they ran and how they ended
      kill(rank)           end one rank now (one gone silent: heartbeat.py)
      stop(timeout_s)      wait for them to end, kill those left
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection

LOCAL_HOST = "127.0.0.1"  # every rank of a group on one host meets here


class RankSet(ABC):
    """Ranks 1..N-1 of a group of `size` ranks, as one launcher runs them. `host`: the
    address they reach rank 0's store at; `local_device`: rank 0's GPU index where the
    launcher chose it (None: rank % GPUs, init_tensor_parallel's default); `grace_s`:
    how long an error in a collective waits for the death behind it to be seen."""

    host = LOCAL_HOST
    local_device: int | None = None
    grace_s = 2.0

    def __init__(self, size: int, backend: str, role: str) -> None:
        self.size, self.backend, self.role = size, backend, role

    @property
    def ranks(self) -> range:
        return range(1, self.size)

    @abstractmethod
    def start(self, entry: Callable[..., None], args: dict[int, tuple]) -> None:
        """Rank r (1..size-1) runs entry(*args[r], device=d), each in its own process or
        actor: d the torch index of the GPU the launcher gave it, in that process, or
        None where the launcher leaves it to the rank (rank % GPUs)."""

    @abstractmethod
    def wait(self, ranks: Collection[int], timeout: float | None) -> dict[int, object]:
        """The ranks among `ranks` that have ended, with their status (an exit code, or
        what ended the actor), waiting up to `timeout` seconds (None: no limit) for one
        to end where none has."""

    @abstractmethod
    def describe(self, ended: dict[int, object]) -> str:
        """The ended ranks named, with how they ended (and where, off this host)."""

    @abstractmethod
    def kill(self, rank: int) -> None:
        """End `rank` now, without waiting for it (a rank that stopped answering)."""

    @abstractmethod
    def stop(self, timeout_s: float) -> None:
        """Wait up to timeout_s for the ranks to end (they were told to), then kill any
        left, and free what the launcher holds for them."""
