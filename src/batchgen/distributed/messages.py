"""What rank 0 tells its tensor-parallel workers: one frozen dataclass per kind of
message, broadcast pickled over the group's gloo side (workers.Workers.send).

A worker acts on each through one table of handlers keyed by type (a message of a type
it has no handler for raises); a message whose `replies` is true is answered by every
worker (Workers.ask gathers the answers, rank 1 first). The step message, `TPStep`,
lives beside the runner that sends it (engine/tensor_parallel.py): it carries the host
tier's copy records, which sit above this package.

    rank 0                                  each worker
    Setup                           -->     its page pool, host tier mirror, runner
    PlanBegin, Profile..., PlanQuery <->    counts its GPU's peak; the pages it has left
    Profile                         -->     the same warm-up forward as rank 0's
    Reconfigure                     <->     its pool re-made; what failed, or None
    TierMetricsQuery                <->     its host tier mirror's counters
    DPStep                          <->     attention data parallel: a tick; finished
    DPQuery                         <->     attention data parallel: metrics, pages held
    Shutdown                        -->     leaves the group, exits
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from batchgen.sampling_params import SamplingParams


class Message:
    """A message from rank 0 to every worker. `replies`: each worker answers it."""

    replies: ClassVar[bool] = False


@dataclass(frozen=True)
class Setup(Message):
    """Build the pools and the runner rank 0 built: `num_pages` device pages, a host
    tier of `host_pages` pages and `host_state_slots` state slots (0: none), and a
    runner that decodes as rank 0's does (the same attention backend; decode CUDA
    graphs where `graphs`)."""

    num_pages: int
    host_pages: int
    host_state_slots: int
    eos_token_ids: tuple[int, ...]
    attention_backend: str
    graphs: bool


@dataclass(frozen=True)
class Profile(Message):
    """Run the warm-up forward rank 0 runs beside it: `num_tokens` prompt tokens in
    prompts of at most `max_len` tokens (memory.warmup_forward), so the ranks'
    collectives pair up."""

    num_tokens: int
    max_len: int
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class PlanBegin(Message):
    """The memory plan starts: count this GPU's peak from now on."""


@dataclass(frozen=True)
class PlanQuery(Message):
    """The memory plan ends: answer the pages this GPU has left (an int)."""

    replies: ClassVar[bool] = True


@dataclass(frozen=True)
class Reconfigure(Message):
    """Re-make the device pool with `num_pages` pages; answer None, or what failed (a
    pool of the old size is made again then)."""

    replies: ClassVar[bool] = True
    num_pages: int


@dataclass(frozen=True)
class TierMetricsQuery(Message):
    """Answer the host tier mirror's counters (a dict; None without the tier), once
    every copy it was sent is done."""

    replies: ClassVar[bool] = True


@dataclass(frozen=True)
class Shutdown(Message):
    """Leave the group and exit (worker_rank.serve returns)."""


def message_types() -> set[type[Message]]:
    """Every concrete message type defined so far (the subclasses of Message, at any
    depth, the step message among them once its module is imported)."""
    found, todo = set(), list(Message.__subclasses__())
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo.extend(cls.__subclasses__())
    return found


class DPMessage:
    """A message from rank 0 to the workers of an attention data-parallel engine
    (engine/dp_rank.py), which act on these alone (and on Shutdown, as every worker
    does): a family apart from `Message`, whose types are the tensor-parallel workers'.
    `replies`: each worker answers it."""

    replies: ClassVar[bool] = False


@dataclass(frozen=True)
class DPRequest:
    """A request an attention data-parallel rank takes: sent to its rank once, with the
    tick after it arrived (its seed already fixed by rank 0, so its noise is the same on
    whatever rank it runs)."""

    rank: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class DPStep(DPMessage):
    """One tick of an attention data-parallel engine: each worker drops the `aborts` it
    holds, where `new` takes the requests rank 0 then scatters to it alone (a list of
    `DPRequest`, possibly empty: Workers.scatter), runs one step of its engine in
    lockstep with the other ranks (distributed.lockstep), and answers what it finished.
    In a steady run the message is empty: a step's bytes do not grow with the requests
    or the tokens the ranks hold, and a request's data goes to its rank alone, once."""

    replies: ClassVar[bool] = True
    new: bool = False
    aborts: tuple[str, ...] = ()


@dataclass(frozen=True)
class DPQuery(DPMessage):
    """Answer `what` of the worker's engine: "metrics" (its metrics dict), "pages"
    (request id -> the device pages it holds, for each request with pages), "slots"
    (request id -> its state slot, linear-attention models) or "statuses"
    (request id -> its RequestStatus, for each unfinished request it holds)."""

    replies: ClassVar[bool] = True
    what: str
