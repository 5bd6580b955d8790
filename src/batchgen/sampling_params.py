"""Per-request sampling parameters, in vLLM's shape."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_MAX_LOGPROBS = 20


@dataclass
class StructuredOutputsParams:
    """Constrain a completion to a language; exactly one of the fields is given.

    json: a JSON schema (dict or JSON text) the completion is an instance of.
    regex: a regular expression the whole completion matches.
    choice: the completion is exactly one of these strings.
    grammar: an EBNF (GBNF-style) grammar whose `root` rule the completion derives.
    json_object: any JSON object (OpenAI's `response_format={"type": "json_object"}`).

    disable_any_whitespace: JSON is written without optional whitespace (compact
    separators), which keeps small models from padding it out to max_tokens.

    The constraint ends with the model's EOS: a completion that reaches max_tokens
    first is cut short (finish_reason "length") and need not parse.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams takes exactly one of json, regex, choice, grammar, "
                f"json_object; got {', '.join(given) if given else 'none'}"
            )
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from e
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(
                f"StructuredOutputsParams.json must be a dict or JSON text, got {type(self.json)}"
            )
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"StructuredOutputsParams.{name} must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("StructuredOutputsParams.choice must be a non-empty list of strings")
        if not isinstance(self.json_object, bool) or not isinstance(
            self.disable_any_whitespace, bool
        ):
            raise ValueError("StructuredOutputsParams flags must be bools")

    @property
    def key(self) -> tuple[str, Any, bool]:
        """What the compiled grammar depends on (equal keys share one compilation)."""
        if self.json is not None:
            spec = (
                self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            )
            return ("json", spec, self.disable_any_whitespace)
        if self.choice is not None:
            return ("choice", tuple(self.choice), False)
        if self.json_object:
            return ("json_object", None, self.disable_any_whitespace)
        kind = "regex" if self.regex is not None else "grammar"
        return (kind, getattr(self, kind), False)


GuidedDecodingParams = StructuredOutputsParams  # vLLM's earlier name for the same thing


@dataclass
class SamplingParams:
    """How to sample one request's completion.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 disable those filters.
    Logprobs, when asked, are those of the model's raw distribution (before
    temperature, penalties and filters), as vLLM reports them.

    n completions per prompt; best_of (>= n, default n) are sampled and the n with the
    highest cumulative logprob returned, best first. Sample i of a seeded request is
    drawn with seed + i.

    structured_outputs (or its earlier name guided_decoding) constrains the completion
    to a JSON schema, a regex, a choice of strings or a grammar; see
    StructuredOutputsParams.

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
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's earlier name
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
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                fail("guided_decoding", "must not be given together with structured_outputs")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            fail("structured_outputs", "must be a StructuredOutputsParams")

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
