"""A request's state: its tokens and how many of them have KV in the cache."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from batchgen.runner.batch import TokenLogprobs
from batchgen.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """Two counters, no phases: len(token_ids) tokens are known, num_computed_tokens
    of them have KV in the cache. A step computes some of the rest; when it reaches
    the end, a new token is sampled and appended."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival: int = 0
    seed: int | None = None  # of its sampling noise: params.seed, or one the engine derives
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # tokens a launched step samples for it that are not appended yet (async
    # scheduling: the next step is scheduled before this one's tokens reach the host)
    num_pending: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # by position
    num_preemptions: int = 0
    text: str = ""
    detok_prefix: int = 0  # incremental detokenization: output ids decoded as context
    detok_read: int = 0  # ... and the ids whose text is already in `text`
    detok_stream: object = None  # or the tokenizers DecodeStream fed those ids
    # read for every row of every step, kept here beside the counters (params' own
    # fields sit in another object, its __dict__: two more cache misses a row):
    num_prompt_tokens: int = field(init=False)  # len(prompt_token_ids)
    min_tokens: int = field(init=False)  # params.min_tokens: no stop before as many
    stops_on_eos: bool = field(init=False)  # not params.ignore_eos
    stop_token_ids: frozenset[int] | None = field(init=False)  # params', None if none

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        p = self.params
        self.min_tokens, self.stops_on_eos = p.min_tokens, not p.ignore_eos
        self.stop_token_ids = frozenset(p.stop_token_ids) or None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def prompt_logprobs_due(self) -> bool:
        """It reports prompt logprobs and some are still to compute."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    def next_inputs(self, n: int) -> list[int]:
        """Its next n input tokens; a token still in flight (async scheduling) is -1, a
        placeholder the runner fills on the device."""
        start = self.num_computed_tokens
        known = self.token_ids[start : start + n]  # a new list: the step may keep it
        return known if len(known) == n else known + [-1] * (n - len(known))

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
