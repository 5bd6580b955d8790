"""Batch output lines in OpenAI's batch output shape: a finished line's answer
(`output_line`, from its `Pending` samples) and an error record (`error_line`);
batch_file.py reads the input lines.

Output line: {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}.
Error line:  {"id", "custom_id", "response": null, "error": {"code", "message", "line",
             "line_digest"}}; code "invalid_request" (the line), "engine_error" (a step).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from batchgen.api.batch_file import CHAT
from batchgen.api.parallel_sampling import select
from batchgen.engine.request import Request
from batchgen.outputs import CompletionOutput
from batchgen.sampling_params import SamplingParams


@dataclass
class Pending:
    """One input line in the engine: what its output line needs, and its samples (one
    engine request each) as they finish."""

    line: int
    custom_id: str
    url: str
    logprobs: int | None  # top-k asked, None when no logprobs
    params: SamplingParams | None = None  # the line's own (n, best_of); None: n = 1
    samples: list[Request | None] = field(default_factory=lambda: [None])
    digest: str | None = None  # line_digest of the input line

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.samples)

    @property
    def usage(self) -> tuple[int, int]:
        """(prompt tokens, completion tokens) of a done line: the prompt counted once,
        every sample's completion (best_of's unreturned ones too)."""
        reqs = self.samples
        return len(reqs[0].prompt_token_ids), sum(len(r.output_token_ids) for r in reqs)


def output_line(p: Pending, model: str, tokenizer) -> dict:
    """A success line in OpenAI's batch output shape: the line's n choices (the n best
    of best_of samples by cumulative logprob when best_of > n), indexed 0..n-1; usage
    counts the prompt once and every sample's completion tokens."""
    reqs = [r for r in p.samples if r is not None]
    choices = []
    for index, req in enumerate(_chosen(p, reqs)):
        lp = _logprobs(p, req, tokenizer) if p.logprobs is not None else None
        if p.url == CHAT:
            choice = {
                "index": index,
                "message": {"role": "assistant", "content": req.text},
                "logprobs": lp,
                "finish_reason": req.finish_reason,
            }
        else:
            choice = {
                "index": index,
                "text": req.text,
                "logprobs": lp,
                "finish_reason": req.finish_reason,
            }
        choices.append(choice)
    kind, prefix = (
        ("chat.completion", "chatcmpl-") if p.url == CHAT else ("text_completion", "cmpl-")
    )
    n_in, n_out = p.usage
    body = {
        "id": prefix + uuid.uuid4().hex,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out},
    }
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": p.custom_id,
        "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
        "error": None,
    }


def _chosen(p: Pending, reqs: list[Request]) -> list[Request]:
    """The samples the line returns, in order (parallel_sampling.select's choice)."""
    if p.params is None or len(reqs) == 1:
        return reqs
    by_tokens = {id(r.output_token_ids): r for r in reqs}
    samples = [
        CompletionOutput(
            index=i,
            text=r.text,
            token_ids=r.output_token_ids,  # select keeps this object: it names the sample
            finish_reason=r.finish_reason,
            cumulative_logprob=sum(lp.sampled_logprob for lp in r.logprobs),
        )
        for i, r in enumerate(reqs)
    ]
    return [by_tokens[id(c.token_ids)] for c in select(p.params, samples)]


def error_line(
    line: int,
    custom_id: Any,
    message: str,
    duplicate_of: int | None = None,
    digest: str | None = None,
    code: str = "invalid_request",
) -> dict:
    """An error line: OpenAI's shape, plus the input line number, the digest of the
    line's bytes (`line_digest`: a rerun retries the line once its text changes) and,
    for a duplicate custom_id, the earlier line that has it (whose answer stands).
    `custom_id` is what the line had, whatever its JSON type (null when none)."""
    error = {"code": code, "message": f"line {line}: {message}", "line": line}
    if duplicate_of is not None:
        error["duplicate_of_line"] = duplicate_of
    if digest is not None:
        error["line_digest"] = digest
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": error,
    }


def _logprobs(p: Pending, req: Request, tokenizer) -> dict:
    def piece(tid: int) -> str:
        return tokenizer.decode([tid])

    if p.url == CHAT:  # OpenAI's content logprobs: the returned content's tokens only
        content = []
        for tok, lp in zip(_content_tokens(req), req.logprobs):
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


def _content_tokens(req: Request) -> list[int]:
    """The output tokens whose text is in the content: without the token that ended the
    request (EOS, or one of its stop_token_ids), which the text leaves out."""
    ids = req.output_token_ids
    ended_by_token = req.finish_reason == "stop" and not isinstance(req.stop_reason, str)
    if ended_by_token and ids and not req.params.include_stop_str_in_output:
        return ids[:-1]
    return ids


def dumps(obj: dict) -> bytes:
    """One JSONL line; lone surrogates (from undecodable tokens) stay valid JSON escapes."""
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", "backslashreplace") + b"\n"
