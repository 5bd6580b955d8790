"""OpenAI batch files: one input line -> a validated request or an error reason (the
output and error lines it gets: batch_output.py).

Input line (OpenAI batch form, or the plain form for quick use):
    {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [...], "max_tokens": 48, ...}}
    {"id": "a", "prompt": "..."}            {"id": "a", "messages": [...], "temperature": 0}
"""

from __future__ import annotations

import difflib
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from batchgen.api.chat_messages import checked_conversation
from batchgen.api.chat_messages import json_type as _json_type
from batchgen.sampling_params import SamplingParams, StructuredOutputsParams

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
URLS = (CHAT, COMPLETIONS)

# body keys read as the SamplingParams field of the same name
_PASSTHROUGH = (
    "temperature top_p top_k min_p seed stop stop_token_ids presence_penalty frequency_penalty "
    "repetition_penalty min_tokens ignore_eos skip_special_tokens include_stop_str_in_output n"
).split()
_GUIDED_KEYS = "guided_json guided_regex guided_choice guided_grammar structured_outputs".split()
# the body keys a line may have, by url: what batchgen reads, and `model` (one model
# runs the job; the line's name for it is not checked)
_COMMON = {
    *_PASSTHROUGH,
    *_GUIDED_KEYS,
    "model",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "response_format",
}
KNOWN_KEYS = {
    CHAT: frozenset({*_COMMON, "messages", "top_logprobs"}),
    COMPLETIONS: frozenset({*_COMMON, "prompt", "best_of"}),
}
# keys OpenAI's API accepts that change nothing batchgen computes: the job warns once
# per key and runs the line
IGNORED_KEYS = frozenset(
    "user store metadata service_tier stream stream_options parallel_tool_calls "
    "prompt_cache_key safety_identifier reasoning_effort verbosity tool_choice "
    "function_call priority request_id".split()
)
# keys OpenAI's API accepts that would change the answer, which batchgen cannot honour:
# a line that sets one (to anything but an empty or false value) is an error
UNSUPPORTED_KEYS = frozenset(
    "logit_bias tools functions audio prediction web_search_options suffix echo".split()
)
BOM = b"\xef\xbb\xbf"

_NO_ID = object()


class LineError(Exception):
    """A reason why one input line cannot run; custom_id when it could be read.
    `record_id`: what the line's custom_id field held, for the error record, when it is
    not a usable custom_id (a number, an empty string)."""

    def __init__(
        self,
        message: str,
        custom_id: str | None = None,
        duplicate_of: int | None = None,
        record_id: Any = _NO_ID,
    ) -> None:
        super().__init__(message)
        self.custom_id = custom_id
        self.duplicate_of = duplicate_of  # the earlier line that has this custom_id
        self.record_id = custom_id if record_id is _NO_ID else record_id
        self.digest: str | None = None  # line_digest of the line, set by its reader


@dataclass
class BatchItem:
    """One structurally valid input line (not yet tokenized)."""

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]
    ignored: tuple[str, ...] = ()  # body keys OpenAI accepts that batchgen ignores
    digest: str | None = None  # line_digest of the line's bytes, for its error records


def line_digest(raw: bytes) -> str:
    """A short digest of an input line's bytes: error records carry it, so a rerun
    retries a line whose text changed since its record was written."""
    return hashlib.blake2b(raw, digest_size=12).hexdigest()


def parse_line(raw: bytes, line: int) -> BatchItem:
    """Decode, parse and check the shape of one input line; raise LineError. A UTF-8
    byte-order mark at the start of line 1 (as some editors write) is skipped."""
    if line == 1 and raw.startswith(BOM):
        raw = raw[len(BOM) :]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LineError(
            f"the line is not valid UTF-8 (byte {raw[e.start]:#04x} at offset {e.start})"
        ) from None
    if not text.strip():
        raise LineError("the line is blank")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineError(f"malformed JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
        raise LineError(f"expected a JSON object, got {_json_type(obj)}")
    if any(k in obj for k in ("custom_id", "method", "url", "body")):
        return _parse_batch_form(obj, line)
    return _parse_plain_form(obj, line)


def _parse_batch_form(obj: dict, line: int) -> BatchItem:
    cid = obj.get("custom_id")
    if cid is None:
        raise LineError("missing custom_id")
    if not isinstance(cid, str) or not cid:
        raise LineError(
            f"custom_id must be a non-empty string, got {_json_type(cid)}", record_id=cid
        )
    if obj.get("method", "POST") != "POST":
        raise LineError(f'method must be "POST", got {obj.get("method")!r}', cid)
    url = obj.get("url")
    if url not in URLS:
        raise LineError(f"unknown url {url!r}; expected one of {', '.join(URLS)}", cid)
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError(f"body must be a JSON object, got {_json_type(body)}", cid)
    _check_input(body, url, cid)
    return BatchItem(line, cid, url, body, _check_keys(body, url, cid))


def _parse_plain_form(obj: dict, line: int) -> BatchItem:
    cid = obj.get("id")
    if cid is None:
        raise LineError('missing custom_id (or "id" in the plain form)')
    if isinstance(cid, int) and not isinstance(cid, bool):
        cid = str(cid)
    if not isinstance(cid, str) or not cid:
        raise LineError(f"id must be a non-empty string, got {_json_type(cid)}", record_id=cid)
    if "messages" in obj:
        url = CHAT
    elif "prompt" in obj:
        url = COMPLETIONS
    else:
        raise LineError('the line has neither "messages" nor "prompt"', cid)
    body = {k: v for k, v in obj.items() if k != "id"}
    _check_input(body, url, cid)
    return BatchItem(line, cid, url, body, _check_keys(body, url, cid))


def _check_keys(body: dict, url: str, cid: str) -> tuple[str, ...]:
    """Refuse a body key batchgen does not know (naming the nearest known one) or cannot
    honour; return the keys it ignores (OpenAI accepts them, they change nothing here)."""
    known, ignored = KNOWN_KEYS[url], []
    for key in body:
        if key in known:
            continue
        if key in IGNORED_KEYS:
            ignored.append(key)
        elif key in UNSUPPORTED_KEYS:
            if body[key] not in (None, False, "", [], {}):
                raise LineError(f"body.{key} is not supported by batchgen", cid)
        else:
            near = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise LineError(f"unknown body field {key!r}{hint}", cid)
    return tuple(ignored)


def _check_input(body: dict, url: str, cid: str) -> None:
    if url == CHAT:
        try:
            checked_conversation(body.get("messages"), "body.")
        except ValueError as e:
            raise LineError(str(e), cid) from None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = body["prompt"] = prompt[0]  # a batch of one
        ok = isinstance(prompt, str) or (
            isinstance(prompt, list) and all(type(t) is int for t in prompt)
        )
        if not ok:
            raise LineError(
                "body.prompt must be a string or a list of token ids (one prompt "
                f"per line), got {_json_type(prompt)}",
                cid,
            )


def sampling_params(body: dict, url: str, defaults: dict[str, Any]) -> SamplingParams:
    """SamplingParams from a request body over the command-line defaults."""
    kw = dict(defaults)
    for key in _PASSTHROUGH:
        if body.get(key) is not None:
            kw[key] = body[key]
    for key in ("max_tokens", "max_completion_tokens"):  # the newer name wins
        if body.get(key) is not None:
            kw["max_tokens"] = body[key]
    if url == COMPLETIONS and body.get("best_of") is not None:
        kw["best_of"] = body["best_of"]
    kw["logprobs"] = requested_logprobs(body, url)
    kw["structured_outputs"] = requested_structure(body)
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        message = str(e)
        if url == CHAT:  # a chat body's top-k is its top_logprobs (logprobs is a bool)
            message = message.replace("SamplingParams.logprobs", "body.top_logprobs")
        raise LineError(message.replace("SamplingParams.", "body.")) from None


_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def requested_structure(body: dict) -> StructuredOutputsParams | None:
    """The body's output constraint: OpenAI's `response_format` (json_object,
    json_schema; text is none), or vLLM's `guided_json` / `guided_regex` /
    `guided_choice` / `guided_grammar` and `structured_outputs` fields; at most one."""
    given = [k for k in ("response_format", "structured_outputs", *_GUIDED) if k in body]
    if body.get("response_format") in ({"type": "text"}, None) and "response_format" in given:
        given.remove("response_format")
    if not given:
        return None
    if len(given) > 1:
        raise LineError(f"body gives more than one output constraint: {', '.join(given)}")
    key = given[0]
    value = body[key]
    try:
        if key == "response_format":
            return _response_format(value)
        if key == "structured_outputs":
            if not isinstance(value, dict):
                raise ValueError(f"must be an object, got {_json_type(value)}")
            return StructuredOutputsParams(**value)
        return StructuredOutputsParams(**{_GUIDED[key]: value})
    except (TypeError, ValueError) as e:
        raise LineError(f"body.{key}: {str(e).replace('StructuredOutputsParams.', '')}") from None


def _response_format(value) -> StructuredOutputsParams:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError('type "json_schema" needs json_schema.schema, a JSON object')
        return StructuredOutputsParams(json=schema)
    raise ValueError(f'type must be "text", "json_object" or "json_schema", got {kind!r}')


def requested_logprobs(body: dict, url: str) -> int | None:
    """Top-k logprobs the body asks for (None: no logprobs)."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if url == COMPLETIONS:
        if lp is None:
            return None
        if type(lp) is not int:
            raise LineError(f"body.logprobs must be an integer, got {_json_type(lp)}")
        return lp
    if lp is not None and not isinstance(lp, bool):
        raise LineError(f"body.logprobs must be a boolean, got {_json_type(lp)}")
    if top is not None and type(top) is not int:
        raise LineError(f"body.top_logprobs must be an integer, got {_json_type(top)}")
    if top is not None and not lp:
        raise LineError("body.top_logprobs needs body.logprobs set to true")
    return (top or 0) if lp else None


def encode(llm, item: BatchItem) -> list[int]:
    """Prompt token ids, through the chat template for chat requests."""
    if item.url == CHAT:
        text = llm.apply_chat_template(checked_conversation(item.body["messages"]))
        return llm.tokenizer.encode(text, add_special_tokens=False)
    prompt = item.body["prompt"]
    return llm.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)


def duplicate_error(custom_id: str, first_line: int) -> LineError:
    """The error of a line whose custom_id an earlier line already has."""
    return LineError(
        f"duplicate custom_id {custom_id!r}: already answered by line {first_line}, whose "
        "answer stands; this line was not run",
        custom_id,
        duplicate_of=first_line,
    )
