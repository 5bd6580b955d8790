"""What the engine runs its ranks through, one rank or N: the builder and EngineCore talk
to an `Executor` and never ask whether there are other ranks. Tensor parallel's is
tp_peers.TPWorkers (ranks 1..N-1 in their own processes, told everything in
distributed.messages); one rank's is `OneRank`, which has no one to tell.

    what the engine asks          OneRank             TPWorkers
    send(message)                 nothing to send     broadcast to every worker
    plan_begin() / plan_pages()   [] (no peer)        each worker's pages left
    runner_cls, runner_args()     ModelRunner         TPModelRunner, sending each step
    reconfigure(n, tier)          [] (nothing failed) each worker's pool re-made
    tier_metrics(tier)            []                  each worker's mirror counters
    step_metrics()                {}                  step messages sent and their bytes
    shutdown()                    nothing             workers stopped, group left
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from batchgen.distributed.messages import Message
from batchgen.runner.model_runner import ModelRunner
from batchgen.runner.paired import Pairing

if TYPE_CHECKING:
    from batchgen.kv.tiered import TieredKVManager


class Executor(Protocol):
    """The ranks an engine runs on, as rank 0 sees them."""

    size: int  # ranks, this one included
    runner_cls: type[ModelRunner]  # rank 0's runner

    def runner_args(self, tier: TieredKVManager | None) -> dict:
        """runner_cls's keyword arguments for this group (the host tier's copy log)."""
        ...

    def send(self, message: Message) -> None:
        """Tell every other rank (a setup, a warm-up step)."""
        ...

    def plan_begin(self) -> None:
        """The memory plan: every other rank starts counting its peak."""
        ...

    def plan_pages(self) -> list[int]:
        """The memory plan: the pages each other rank's GPU has left."""
        ...

    def reconfigure(self, num_pages: int, tier: TieredKVManager | None) -> list[str]:
        """Every other rank's pool re-made with num_pages pages, after the tier's copies
        submitted since the last message; what failed, by rank."""
        ...

    def tier_metrics(self, tier: TieredKVManager | None) -> list[dict | None]:
        """Every other rank's host tier mirror counters, once the tier's copies reached
        and left them."""
        ...

    def step_metrics(self) -> dict:
        """What rank 0 sent the other ranks in step messages: their count and pickled
        bytes (`step_message_bytes` a step); empty with no other rank."""
        ...

    def shutdown(self) -> None:
        """Stop the other ranks (a second call does nothing)."""
        ...


class OneRank:
    """The executor of an engine on one rank: there is no other rank to tell, ask, or
    stop. pairing: an attention data-parallel rank's rounds (distributed.lockstep.
    Lockstep; each rank is an engine of one rank whose forwards pair with the other
    ranks'), handed to its runner (runner/paired.py); None: one engine alone."""

    size = 1
    runner_cls = ModelRunner

    def __init__(self, pairing: Pairing | None = None) -> None:
        self.pairing = pairing

    def runner_args(self, tier: TieredKVManager | None) -> dict:
        return {} if self.pairing is None else {"pairing": self.pairing}

    def send(self, message: Message) -> None:
        pass

    def plan_begin(self) -> None:
        pass

    def plan_pages(self) -> list[int]:
        return []

    def reconfigure(self, num_pages: int, tier: TieredKVManager | None) -> list[str]:
        return []

    def tier_metrics(self, tier: TieredKVManager | None) -> list[dict | None]:
        return []

    def step_metrics(self) -> dict:
        return {}

    def shutdown(self) -> None:
        pass
