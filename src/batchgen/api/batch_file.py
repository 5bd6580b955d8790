"""OpenAI batch files: one input line -> a validated request or an error reason, and the
output / error lines in OpenAI's batch output shape.

Input line (OpenAI batch form, or the plain form for quick use):
    {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [...], "max_tokens": 48, ...}}
    {"id": "a", "prompt": "..."}            {"id": "a", "messages": [...], "temperature": 0}

Output line: {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}.
Error line:  {"id", "custom_id", "response": null, "error": {"code", "message", "line"}}.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from batchgen.engine.request import Request
from batchgen.sampling_params import SamplingParams, StructuredOutputsParams

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
URLS = (CHAT, COMPLETIONS)

# body keys read as the SamplingParams field of the same name
_PASSTHROUGH = (
    "temperature top_p top_k min_p seed stop stop_token_ids presence_penalty frequency_penalty "
    "repetition_penalty min_tokens ignore_eos skip_special_tokens include_stop_str_in_output n"
).split()

# chat roles a batch line may use; "developer" (OpenAI's newer name for the system
# message) reaches the chat template as "system", the role templates know. "tool" and
# "function" are refused: a tool result needs the assistant's tool call and the tools
# list, which batch lines cannot pass to the template.
ROLES = ("system", "user", "assistant", "developer")
_TEMPLATE_ROLE = {"developer": "system"}


class LineError(Exception):
    """A reason why one input line cannot run; custom_id when it could be read."""

    def __init__(
        self, message: str, custom_id: str | None = None, duplicate_of: int | None = None
    ) -> None:
        super().__init__(message)
        self.custom_id = custom_id
        self.duplicate_of = duplicate_of  # the earlier line that has this custom_id


@dataclass
class BatchItem:
    """One structurally valid input line (not yet tokenized)."""

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass
class Pending:
    """What the output line needs once the engine has finished a request."""

    line: int
    custom_id: str
    url: str
    logprobs: int | None  # top-k asked, None when no logprobs


def parse_line(raw: bytes, line: int) -> BatchItem:
    """Decode, parse and check the shape of one input line; raise LineError."""
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
        raise LineError(f"custom_id must be a non-empty string, got {_json_type(cid)}")
    if obj.get("method", "POST") != "POST":
        raise LineError(f'method must be "POST", got {obj.get("method")!r}', cid)
    url = obj.get("url")
    if url not in URLS:
        raise LineError(f"unknown url {url!r}; expected one of {', '.join(URLS)}", cid)
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError(f"body must be a JSON object, got {_json_type(body)}", cid)
    _check_input(body, url, cid)
    return BatchItem(line, cid, url, body)


def _parse_plain_form(obj: dict, line: int) -> BatchItem:
    cid = obj.get("id")
    if cid is None:
        raise LineError('missing custom_id (or "id" in the plain form)')
    if isinstance(cid, int) and not isinstance(cid, bool):
        cid = str(cid)
    if not isinstance(cid, str) or not cid:
        raise LineError(f"id must be a non-empty string, got {_json_type(cid)}")
    if "messages" in obj:
        url = CHAT
    elif "prompt" in obj:
        url = COMPLETIONS
    else:
        raise LineError('the line has neither "messages" nor "prompt"', cid)
    body = {k: v for k, v in obj.items() if k != "id"}
    _check_input(body, url, cid)
    return BatchItem(line, cid, url, body)


def _check_input(body: dict, url: str, cid: str) -> None:
    if url == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise LineError(f"body.messages must be a list, got {_json_type(messages)}", cid)
        if not messages:
            raise LineError("body.messages is empty", cid)
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise LineError(f"body.messages[{i}] must be an object with a string role", cid)
            if m["role"] not in ROLES:
                raise LineError(
                    f"body.messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role']!r}",
                    cid,
                )
            content = m.get("content")
            if isinstance(content, list):
                if not all(
                    isinstance(p, dict)
                    and p.get("type") == "text"
                    and isinstance(p.get("text"), str)
                    for p in content
                ):
                    raise LineError(
                        f"body.messages[{i}].content: only text parts are supported", cid
                    )
            elif not isinstance(content, str) and not (content is None and m["role"] != "user"):
                raise LineError(
                    f"body.messages[{i}].content must be a string or a list of "
                    f"text parts, got {_json_type(content)}",
                    cid,
                )
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
        messages = [_flatten(m) for m in item.body["messages"]]
        text = llm.apply_chat_template(messages)
        return llm.tokenizer.encode(text, add_special_tokens=False)
    prompt = item.body["prompt"]
    return llm.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)


def _flatten(message: dict) -> dict:
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p["text"] for p in content)
    role = _TEMPLATE_ROLE.get(message["role"], message["role"])
    return {**message, "role": role, "content": content if content is not None else ""}


def output_line(p: Pending, req: Request, model: str, tokenizer) -> dict:
    """A success line in OpenAI's batch output shape."""
    lp = _logprobs(p, req, tokenizer) if p.logprobs is not None else None
    if p.url == CHAT:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": req.text},
            "logprobs": lp,
            "finish_reason": req.finish_reason,
        }
        kind, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {"index": 0, "text": req.text, "logprobs": lp, "finish_reason": req.finish_reason}
        kind, prefix = "text_completion", "cmpl-"
    n_in, n_out = len(req.prompt_token_ids), len(req.output_token_ids)
    body = {
        "id": prefix + uuid.uuid4().hex,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out},
    }
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": p.custom_id,
        "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
        "error": None,
    }


def error_line(
    line: int, custom_id: str | None, message: str, duplicate_of: int | None = None
) -> dict:
    """An error line: OpenAI's shape, plus the input line number and, for a duplicate
    custom_id, the earlier line that has it (whose answer stands)."""
    error = {"code": "invalid_request", "message": f"line {line}: {message}", "line": line}
    if duplicate_of is not None:
        error["duplicate_of_line"] = duplicate_of
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": error,
    }


def duplicate_error(custom_id: str, first_line: int) -> LineError:
    """The error of a line whose custom_id an earlier line already has."""
    return LineError(
        f"duplicate custom_id {custom_id!r}: already answered by line {first_line}, whose "
        "answer stands; this line was not run",
        custom_id,
        duplicate_of=first_line,
    )


def _logprobs(p: Pending, req: Request, tokenizer) -> dict:
    def piece(tid: int) -> str:
        return tokenizer.decode([tid])

    if p.url == CHAT:
        content = []
        for tok, lp in zip(req.output_token_ids, req.logprobs):
            s = piece(tok)
            content.append(
                {
                    "token": s,
                    "logprob": lp.sampled_logprob,
                    "bytes": list(s.encode("utf-8", "replace")),
                    "top_logprobs": [
                        {
                            "token": piece(t),
                            "logprob": v,
                            "bytes": list(piece(t).encode("utf-8", "replace")),
                        }
                        for t, v in lp.top
                    ],
                }
            )
        return {"content": content}
    tokens, offsets, offset = [], [], 0
    for tok in req.output_token_ids:
        tokens.append(piece(tok))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [lp.sampled_logprob for lp in req.logprobs],
        "top_logprobs": [
            {**{piece(t): v for t, v in lp.top}, s: lp.sampled_logprob}
            for s, lp in zip(tokens, req.logprobs)
        ],
        "text_offset": offsets,
    }


def dumps(obj: dict) -> bytes:
    """One JSONL line; lone surrogates (from undecodable tokens) stay valid JSON escapes."""
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", "backslashreplace") + b"\n"


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return f"a number ({v!r})"
    if isinstance(v, str):
        return "an empty string" if not v else "a string"
    if isinstance(v, list):
        return "an array"
    return "an object" if isinstance(v, dict) else type(v).__name__
