"""Per-request sampling parameters, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

_MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to sample one request's completion.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 disable those filters.
    Logprobs, when asked, are those of the model's raw distribution (before
    temperature, penalties and filters), as vLLM reports them.

    n completions per prompt; best_of (>= n, default n) are sampled and the n with the
    highest cumulative logprob returned, best first. Sample i of a seeded request is
    drawn with seed + i.

    prompt_logprobs=k reports, per prompt position after the first, the logprob and
    rank of the prompt token and the top k; such a request computes its whole prompt
    (prefix-cache hits would skip positions), as in vLLM.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    best_of: int | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            if not is_num(getattr(self, name)):
                fail(name, "must be a number")
            if getattr(self, name) != getattr(self, name):
                fail(name, "must not be NaN")
        if self.temperature < 0:
            fail("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1):
            fail("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if self.top_k == -1:
            self.top_k = 0
        if not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        if self.seed is not None and not is_int(self.seed):
            fail("seed", "must be an integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if not -2 <= self.presence_penalty <= 2:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            fail("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be > 0")
        if self.logprobs is not None and (
            not is_int(self.logprobs) or not 0 <= self.logprobs <= _MAX_LOGPROBS
        ):
            fail("logprobs", f"must be an integer in [0, {_MAX_LOGPROBS}] or None")
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= _MAX_LOGPROBS
        ):
            fail("prompt_logprobs", f"must be an integer in [0, {_MAX_LOGPROBS}] or None")
        if not is_int(self.n) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if self.best_of is not None and (not is_int(self.best_of) or self.best_of < self.n):
            fail("best_of", f"must be an integer >= n ({self.n}) or None")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = []
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            fail("stop", "must be a string or a list of strings")
        if any(s == "" for s in stop):
            fail("stop", "must not contain an empty string")
        self.stop_strings = list(stop)
        ids = self.stop_token_ids or []
        if not isinstance(ids, (list, tuple)) or not all(is_int(t) and t >= 0 for t in ids):
            fail("stop_token_ids", "must be a list of non-negative integers")
        self.stop_token_ids = list(ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be a bool")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
