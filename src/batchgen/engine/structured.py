"""Structured outputs: grammars compiled once, one matcher per request, next-token masks.

xgrammar does the grammar work (chosen over llguidance by measured mask cost at batch
256, see benchmarks/HISTORY.md, 2026-12-01). A request's `StructuredOutputsParams` are
compiled when it arrives (equal constraints share one compilation, so a bad schema
fails the request at once, naming it), and it gets a `GrammarMatcher` that follows its
tokens: the engine feeds it every token the scheduler appends (`advance`).

Per step, `bitmask(request_ids, out)` fills one packed row per request on the host (int32
words, bit j of word i allowing token 32 * i + j; rows of unconstrained requests allow
everything) with xgrammar's batched, multi-threaded fill, into rows the runner owns
(pinned, reused: `runner.mask_staging.MaskStaging`), which it copies to the device in
one copy and masks the logits there (`runner.sampler.apply_token_bitmask`).
Nothing waits on the device for it: in a pipelined decode the mask of step N+1 is filled
while the GPU runs N+1's forward, once N's tokens have reached the matchers.

On a small model every step is host-bound, so the per-step path costs one dict lookup per
row besides xgrammar's own work: the matchers still following their grammar are kept
apart (`_live`), so neither the fill nor the feed asks each matcher whether it has
terminated (a matcher terminates only on a stop token it accepts; only then is it asked).
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict

import numpy as np

from batchgen.sampling_params import StructuredOutputsParams

# xgrammar's character classes of a JSON string character, and what JSON allows: no raw
# control character (U+0000-U+001F) and no surrogate code point (not UTF-8, so not JSON
# text; xgrammar's classes admit them encoded as three bytes)
_STRING_CHARS = {
    r"[^\"\\\r\n]": r"[^\0-\x1f\"\\\ud800-\udfff]",  # a string with a length bound
    r"[^\0-\x1f\"\\\r\n]": r"[^\0-\x1f\"\\\ud800-\udfff]",  # any other string
}


COMPILED_CACHE = 256  # distinct constraints kept compiled, by default

# "[03:12:12] /project/cpp/regex_converter.cc:94: " before xgrammar's error messages
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ", re.MULTILINE)


class StructuredOutputs:
    """The engine's grammar state: a compiler for its tokenizer and the live matchers;
    the last `compiled_cache` distinct constraints stay compiled (least recently used
    dropped). Built with the engine, it loads xgrammar and reads the tokenizer's
    vocabulary only when the first grammar is compiled: an engine without constrained
    requests never loads it."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: list[int],
        compiled_cache: int = COMPILED_CACHE,
    ) -> None:
        self._tokenizer, self._eos_token_ids = tokenizer, list(eos_token_ids)
        self._xgr = None  # the compiler and the batch matcher are made with it (_load)
        self._compiled: OrderedDict[tuple, object] = OrderedDict()
        self._compiled_cache = compiled_cache
        self._matchers: dict[str, object] = {}  # every followed request
        self._live: dict[str, object] = {}  # those whose matcher has not terminated
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)  # int32 words per row

    def _load(self) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._eos_token_ids
        )
        threads = grammar_threads()
        # one cache, ours: bounded, where xgrammar's own would keep every schema ever seen
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self._stop_ids = frozenset(info.stop_token_ids)  # those that end a matcher
        self._xgr = xgr

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of `spec` (the last `compiled_cache` kept); ValueError
        saying what is wrong."""
        if self._xgr is None:
            self._load()
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
            if len(self._compiled) > self._compiled_cache:  # matchers keep theirs alive
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
        compiled = self.compile(spec)  # xgrammar loaded first
        matcher = self._xgr.GrammarMatcher(compiled)
        self._matchers[request_id] = self._live[request_id] = matcher

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._live.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    @property
    def following(self) -> bool:
        """Whether any request's tokens are constrained now."""
        return bool(self._live)

    def constrains(self, request_ids: list[str]) -> bool:
        """Whether any of these requests' next token is constrained."""
        live = self._live
        return bool(live) and any(rid in live for rid in request_ids)

    def accept(self, request_id: str, token_id: int) -> bool:
        """`advance` for one request: False if its grammar rejects the token."""
        return not self.advance([request_id], [token_id])

    def advance(self, request_ids: list[str], token_ids: list[int]) -> list[str]:
        """Advance each request's matcher by the token it sampled; returns the requests
        whose grammar rejects theirs (only possible when something else masked the
        logits too, e.g. min_tokens forbidding the EOS a finished grammar allows), whose
        matchers stay where they were. Requests without a live matcher are skipped.

        One call per row: xgrammar's `batch_accept_token` measured slower than this loop
        on the CPU (its argument conversion costs more than the calls it saves)."""
        live = self._live
        rejected = []
        for rid, token in zip(request_ids, token_ids):
            matcher = live.get(rid)
            if matcher is None:
                continue
            if not matcher.accept_token(token):
                rejected.append(rid)
            elif token in self._stop_ids and matcher.is_terminated():
                del live[rid]
        return rejected

    def bitmask(self, request_ids: list[str], out: np.ndarray | None = None) -> np.ndarray | None:
        """Packed next-token masks of these rows, or None when none is constrained:
        `out[:len(request_ids)]` (int32 [rows >= len(request_ids), words], C-contiguous;
        a new array when None), every row written: a constrained row by xgrammar, the
        others all ones (everything allowed)."""
        live = self._live
        rows = [i for i, rid in enumerate(request_ids) if rid in live]
        if not rows:
            return None
        n = len(request_ids)
        if out is None:
            out = np.empty((n, self.words), dtype=np.int32)
        out = out[:n]
        if len(rows) < n:
            free = np.ones(n, dtype=bool)
            free[rows] = False
            out[free] = -1
        matchers = [live[request_ids[i]] for i in rows]
        self._batch.batch_fill_next_token_bitmask(matchers, out, rows)
        return out


def grammar_threads() -> int:
    """Threads for xgrammar's batched mask fill and its compiler: the CPUs this process
    may run on (its affinity: a container or a data-parallel shard may hold fewer than
    the machine has), at most 8, the count the H200 host's runs used (16 cores, shared
    with the engine's own thread and the driver's). xgrammar's "auto" would take half
    the machine's hardware threads whatever the affinity."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))
