"""The plain data the scheduler hands the runner, and what the runner hands back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from batchgen.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute tokens [start, start + len(new_token_ids)).

        all tokens:  | computed (KV in pages) | new_token_ids | not yet scheduled |
                     0                      start        start + n
    `sample` is true when the step reaches the request's last known token, so the
    logits of its last new token choose the next token. `seed` seeds its sampling noise
    (with the step; None: the shared generator). `state_slot`: its compressed-state slot
    in a model with linear-attention layers (kv/state_pool.py), else None.
    """

    request_id: str
    new_token_ids: list[int]
    start: int
    page_table: list[int]
    sample: bool
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int | None = None
    state_slot: int | None = None


@dataclass
class SchedulerOutput:
    requests: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # copy handles (host -> device page loads) the forward must wait for on its stream
    wait_for: list = field(default_factory=list)
    # called with a layer index right after that layer's K/V write (per-layer appends)
    on_kv_written: Callable[[int], None] | None = None
    # requests that left the running set since the last step (finished, aborted,
    # preempted): the runner drops what it keeps per running request
    released_ids: list[str] = field(default_factory=list)
    # Scheduler.commit: the tokens it counted per request, for apply to match (None:
    # not committed yet)
    committed: dict[str, int] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(r.new_token_ids) for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass
class TokenLogprobs:
    """Raw logprobs at one sampled position."""

    sampled_logprob: float
    sampled_rank: int
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class ModelRunnerOutput:
    """Per sampled request (in scheduled order): the new token and, if asked, logprobs;
    per request asking for prompt logprobs, those of the prompt positions computed
    ({position: TokenLogprobs}, see runner/prompt_logprobs.py)."""

    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: dict[str, dict[int, TokenLogprobs]] = field(default_factory=dict)
