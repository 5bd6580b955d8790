"""Structured outputs: grammars compiled once, one matcher per request, next-token masks.

xgrammar does the grammar work (chosen over llguidance by measured mask cost at batch
256, see benchmarks/grammar_mask_cost.py). A request's `StructuredOutputsParams` are
compiled when it arrives (equal constraints share one compilation, so a bad schema
fails the request at once, naming it), and it gets a `GrammarMatcher` that follows its
tokens: the engine feeds it every token the scheduler appends.

Per step, `bitmask(request_ids)` fills one packed row per request on the host (int32
words, bit j of word i allowing token 32 * i + j; rows of unconstrained requests allow
everything) with xgrammar's batched fill; the runner stages it to the device with the
step's other inputs and masks the logits there (`runner.sampler.apply_token_bitmask`).
Nothing waits on the device for it: in a pipelined decode the mask of step N+1 is filled
while the GPU runs N+1's forward, once N's tokens have reached the matchers.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict

import numpy as np
import torch

from batchgen.sampling_params import StructuredOutputsParams

# xgrammar's character classes of a JSON string character, and what JSON allows: no raw
# control character (U+0000-U+001F) and no surrogate code point (not UTF-8, so not JSON
# text; xgrammar's classes admit them encoded as three bytes)
_STRING_CHARS = {
    r"[^\"\\\r\n]": r"[^\0-\x1f\"\\\ud800-\udfff]",  # a string with a length bound
    r"[^\0-\x1f\"\\\r\n]": r"[^\0-\x1f\"\\\ud800-\udfff]",  # any other string
}


COMPILED_CACHE = 256  # distinct constraints kept compiled (least recently used dropped)

# "[03:12:12] /project/cpp/regex_converter.cc:94: " before xgrammar's error messages
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ", re.MULTILINE)


class StructuredOutputs:
    """The engine's grammar state: a compiler for its tokenizer and the live matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        import xgrammar as xgr  # here: an engine without constrained requests never loads it

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        threads = max(1, min(8, os.cpu_count() or 1))
        # one cache, ours: bounded, where xgrammar's own would keep every schema ever seen
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self._compiled: OrderedDict[tuple, object] = OrderedDict()
        self._matchers: dict[str, object] = {}
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)  # int32 words per row

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of `spec` (the last COMPILED_CACHE kept); ValueError
        saying what is wrong."""
        key = spec.key
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
        else:
            try:
                compiled = self._compile(spec)
            except (RuntimeError, ValueError, TypeError) as e:
                kind = key[0].replace("_", " ")
                why = _XGRAMMAR_LOG_PREFIX.sub("", str(e)).strip()
                raise ValueError(f"the structured-output {kind} does not compile: {why}") from e
            self._compiled[key] = compiled
            if len(self._compiled) > COMPILED_CACHE:  # matchers keep theirs alive
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams):
        c = self._compiler
        if spec.json is not None or spec.json_object:
            schema = spec.json if spec.json is not None else {"type": "object"}
            return c.compile_grammar(self._json_grammar(schema, spec.disable_any_whitespace))
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            # each choice a literal: JSON string escapes are the grammar's escapes
            rule = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice)
            return c.compile_grammar(f"root ::= {rule}")
        return c.compile_grammar(spec.grammar)

    def _json_grammar(self, schema: dict | str, compact: bool):
        """The schema's grammar with its strings narrowed to valid JSON (see
        `_STRING_CHARS`): xgrammar lets a length-bounded string take raw control
        characters and any string take surrogates, which no strict parser accepts."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        grammar = self._xgr.Grammar.from_json_schema(
            text, any_whitespace=not compact, separators=(",", ":") if compact else None
        )
        ebnf = str(grammar)
        narrowed = ebnf
        for lax, strict in _STRING_CHARS.items():
            narrowed = narrowed.replace(lax, strict)
        return grammar if narrowed == ebnf else self._xgr.Grammar.from_ebnf(narrowed)

    def add(self, request_id: str, spec: StructuredOutputsParams) -> None:
        """Follow a new request under `spec` (compiled here if not yet)."""
        self._matchers[request_id] = self._xgr.GrammarMatcher(self.compile(spec))

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher by a token it sampled; False if the grammar
        rejects it (only possible when something else masked the logits too, e.g.
        min_tokens forbidding the EOS a finished grammar allows)."""
        matcher = self._matchers.get(request_id)
        if matcher is None or matcher.is_terminated():
            return True
        return bool(matcher.accept_token(token_id))

    def bitmask(self, request_ids: list[str]) -> np.ndarray | None:
        """Packed next-token masks of these rows, or None when none is constrained:
        [len(request_ids) * words] int32 words, padded with one more to an even count
        so the array reads as int64 (what the runner stages)."""
        rows, matchers = [], []
        for i, rid in enumerate(request_ids):
            m = self._matchers.get(rid)
            if m is not None and not m.is_terminated():
                rows.append(i)
                matchers.append(m)
        if not rows:
            return None
        n = len(request_ids) * self.words
        mask = np.full(n + n % 2, -1, dtype=np.int32)
        rows_view = torch.from_numpy(mask[:n].reshape(len(request_ids), self.words))
        self._batch.batch_fill_next_token_bitmask(matchers, rows_view, rows)
        return mask
