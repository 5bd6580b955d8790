"""The plain data the scheduler hands the runner, and what the runner hands back.

A step (`SchedulerOutput`) is ids and ints only, so it pickles to another rank as it is:

    SchedulerOutput
      requests: ScheduledRequest per request, in the order its rows are packed
        request_id, new_token_ids, start, sample, num_output_tokens, state_slot
        new_pages   pages appended to its page list since the runner last saw it
                    (all of them the first time)
        new         NewRequest (params, prompt, output so far, seed) the first time the
                    runner sees it (admitted, or again after it was released), else None
      released_ids  requests that left the running set: the runner drops their rows
      preempted_ids
      blind         every entry's new_token_ids is [-1] and it samples (a blind decode step)

The runner keeps what stays fixed while a request runs (runner/input_batch.py), so a
running request costs a step its new tokens and its new pages, never its whole page
list, prompt or output. This process's handles for a step's host-tier copies and the
per-layer store hook (`StepCopies`) travel beside the step, never in it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat

from batchgen.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequest:
    """What the runner keeps for a request while it runs, sent with its first step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated before this admission (a resumed request)
    seed: int | None = None  # of its sampling noise (with the step; None: shared generator)


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute tokens [start, start + len(new_token_ids)).

        all tokens:  | computed (KV in pages) | new_token_ids | not yet scheduled |
                     0                      start        start + n
    `sample` is true when the step reaches the request's last known token, so the
    logits of its last new token choose the next token. `num_output_tokens`: tokens it
    has generated that are on the host (a -1 input token is one more, in flight).
    `new_pages`: the pages added to its page list since the runner's last step of it,
    all of them when `new` is set. `state_slot`: its compressed-state slot in a model
    with linear-attention layers (kv/state_pool.py), else None. Never changed once made
    (a slotted record, not a frozen one: a step makes one a running request, and a
    frozen dataclass costs three times as much to build).
    """

    request_id: str
    new_token_ids: list[int]
    start: int
    new_pages: Sequence[int]
    sample: bool
    num_output_tokens: int = 0
    state_slot: int | None = None
    new: NewRequest | None = None


# a blind decode row's input, one list for every such row: an entry is never changed once
# made, and ~900 lists a step less is fewer young collections of the cyclic collector
PLACEHOLDER: list[int] = [-1]


class BlindEntries(Sequence):
    """A blind decode step's entries as columns (engine/runner_feed.py makes them): row i
    is `ScheduledRequest(request_ids[i], PLACEHOLDER, starts[i], (), True,
    num_output_tokens[i])` unless `general` (row -> entry) holds its entry (new pages, a
    request new to the runner, a state slot), whose fields the columns repeat. Its rows'
    readers on every step (the runner's apply, pack_step, the sampling steps, the
    update) take the columns; an entry is made where indexed or iterated, never kept.
    Pickles as its columns."""

    __slots__ = ("request_ids", "starts", "num_output_tokens", "general")

    def __init__(
        self,
        request_ids: list[str],
        starts: list[int],
        num_output_tokens: list[int],
        general: dict[int, ScheduledRequest],
    ) -> None:
        self.request_ids, self.starts = request_ids, starts
        self.num_output_tokens, self.general = num_output_tokens, general

    def __len__(self) -> int:
        return len(self.request_ids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        if i < 0:
            i += len(self)
        entry = self.general.get(i) if self.general else None
        if entry is not None:
            return entry
        return ScheduledRequest(
            self.request_ids[i],
            PLACEHOLDER,
            self.starts[i],
            (),
            True,
            self.num_output_tokens[i],
        )

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __eq__(self, other) -> bool:
        if isinstance(other, (BlindEntries, list)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None


def row_fields(entries) -> Iterator[tuple[str, int, bool, int]]:
    """(request id, tokens computed, samples, start) of each entry of a step, in order: a
    `BlindEntries`' from its columns (one token, sampling), no entry made a row."""
    if isinstance(entries, BlindEntries):
        return zip(entries.request_ids, repeat(1), repeat(True), entries.starts)
    return ((s.request_id, len(s.new_token_ids), s.sample, s.start) for s in entries)


@dataclass(frozen=True)
class SchedulerOutput:
    requests: list[ScheduledRequest] | BlindEntries = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # requests that left the running set since the last step (finished, aborted,
    # preempted): the runner drops what it keeps per running request
    released_ids: list[str] = field(default_factory=list)
    # every entry computes one placeholder token (-1) and samples (a decode step built
    # blind, pipeline.next_decode, whose `requests` are `BlindEntries`): the runner
    # takes its token columns without a pass over its rows
    blind: bool = False

    @property
    def num_tokens(self) -> int:
        if self.blind:
            return len(self.requests)
        return sum(len(r.new_token_ids) for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True)
class StepCopies:
    """This process's side of a step's host-tier copies, handed to the runner beside the
    step and never sent to another rank: the copy handles the forward waits for on its
    stream, and `on_kv_written(layer)`, called right after each layer's K/V write
    (decode_append="layer")."""

    wait_for: list = field(default_factory=list)
    on_kv_written: Callable[[int], None] | None = None


NO_COPIES = StepCopies()


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
    # the step's entries (`SchedulerOutput.requests`) where its rows are exactly those,
    # in order (every row sampled): the update then takes the rows' requests as its feed
    # made them without comparing ids
    step_entries: list[ScheduledRequest] | None = None
