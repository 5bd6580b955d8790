"""Structured outputs: every completion that ends by EOS parses and validates, in the
default configuration (pipelined decode on, EOS endings, sampling), with the masks
filled by xgrammar and applied on the logits' device.

The tiny model is random, so whatever the grammar allows it picks nearly at random:
schemas are bounded (enums, ranges, maxLength) so each completion ends well within
max_tokens, and a constraint that failed would show as invalid text at once."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr
from conftest import record_launches, save_byte_tokenizer, save_tiny_model

from batchgen import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from batchgen.runner.sampler import apply_token_bitmask

KW = dict(device="cpu", dtype="float32", page_size=4, max_model_len=192, max_num_batched_tokens=128)

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["ok", "n", "color", "name", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("structured")
    save_tiny_model(path, "LlamaForCausalLM")
    save_byte_tokenizer(path)  # every string encodes: the grammar can write any JSON
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), **KW)


PROMPTS = [[5 + i, 40 + 3 * i, 7] for i in range(12)]


def _texts(outs) -> list[tuple[str, str]]:
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def _generate(llm, spec, n_prompts=12, **kw):
    params = SamplingParams(temperature=1.0, max_tokens=160, structured_outputs=spec, **kw)
    outs = llm.generate(PROMPTS[:n_prompts], params, use_tqdm=False)
    assert len(llm.engine.grammar) == 0  # every matcher released with its request
    return _texts(outs)


@pytest.mark.parametrize("compact", [False, True])
def test_json_schema_outputs_validate(llm, compact):
    rows = _generate(llm, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=compact))
    spaced = []
    for text, reason in rows:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)  # strict: no raw control characters
        outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', "", text)
        spaced.append(bool(re.search(r"\s", outside_strings)))
    assert any(spaced) is not compact  # optional whitespace only where allowed


def test_json_object_is_an_object(llm):
    # OpenAI's json_object: any JSON object, never a bare array or scalar
    rows = _generate(llm, StructuredOutputsParams(json_object=True))
    for text, reason in rows:
        if reason == "stop":
            assert isinstance(json.loads(text), dict), text
    assert sum(reason == "stop" for _, reason in rows) >= len(rows) // 2


def test_choice_regex_and_grammar(llm):
    choices = ["yes", "no", 'say "maybe"\\n']
    for text, reason in _generate(llm, StructuredOutputsParams(choice=choices)):
        assert reason == "stop" and text in choices
    for text, reason in _generate(llm, StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{2}")):
        assert reason == "stop" and re.fullmatch(r"[a-c]{3}-[0-9]{2}", text), text
    grammar = 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [xyz] | "nil"'
    for text, reason in _generate(llm, StructuredOutputsParams(grammar=grammar)):
        assert reason == "stop" and re.fullmatch(r"\((?:[xyz]|nil)(?:,(?:[xyz]|nil)){0,3}\)", text)


def test_constrained_and_free_requests_share_a_batch(llm):
    """Rows without a constraint sample exactly as they would alone."""
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS[:4], free, use_tqdm=False)
    spec = StructuredOutputsParams(regex=r"[0-9]{4}")
    bound = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=spec)
    mixed = llm.generate(PROMPTS[:4] * 2, [free] * 4 + [bound] * 4, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    assert all(re.fullmatch(r"[0-9]{4}", o.outputs[0].text) for o in mixed[4:])


def _run(model_dir, params, pipeline: bool, **kw):
    llm = LLM(model=str(model_dir), pipeline_decode=pipeline, **{**KW, **kw})
    launches = record_launches(llm.engine.runner)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    # a step whose sampling waited for its predecessor's tokens (still pending at launch)
    deferred = sum(flight.deferred for flight, _ in launches)
    return _texts(outs), deferred, llm.engine


def test_pipelined_decode_defers_sampling_and_changes_nothing(model_dir):
    """With the pipeline on (the default) a step queued behind another samples only
    once the other's tokens reached the matchers; the outputs are those of plain
    stepping, and sampling stays unseeded (per-request seeds from the engine)."""
    params = SamplingParams(
        temperature=1.0, max_tokens=160, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    plain, deferred, _ = _run(model_dir, params, False)
    assert deferred == 0
    piped, deferred, _ = _run(model_dir, params, True)
    assert deferred > 0, "no step sampled after its predecessor's tokens"
    assert piped == plain
    for text, reason in piped:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


def test_preempted_requests_keep_their_grammar_state(model_dir):
    """A pool too small for the batch preempts requests mid-JSON; recomputed or
    swapped back, they continue where their matcher is."""
    params = SamplingParams(
        temperature=1.0, max_tokens=160, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    ample, _, _ = _run(model_dir, params, True)
    for extra in ({}, {"host_kv_size_gib": 0.01, "tier_policy": "always"}):
        tight, _, engine = _run(model_dir, params, True, num_kv_pages=60, **extra)
        assert engine.scheduler.num_preemptions > 0
        assert tight == ample


def test_n_samples_each_follow_the_grammar(llm):
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(temperature=1.0, max_tokens=160, n=3, structured_outputs=spec)
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 9 and len(set(texts)) > 1
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_guided_decoding_is_the_earlier_name(llm):
    spec = GuidedDecodingParams(choice=["up", "down"])
    params = SamplingParams(temperature=1.0, max_tokens=8, guided_decoding=spec)
    assert params.structured_outputs is spec and params.guided_decoding is None
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    assert all(o.outputs[0].text in ("up", "down") for o in outs)


def test_bad_constraints_are_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="a+")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="together"):
        SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="a"),
            guided_decoding=StructuredOutputsParams(regex="b"),
        )
    good = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a"))
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(a"))
    steps = llm.engine.stats.steps
    with pytest.raises(
        ValueError, match=r"^prompt 1: the structured-output regex does not compile: Regex"
    ):
        llm.generate(PROMPTS[:2], [good, bad], use_tqdm=False)
    assert llm.engine.stats.steps == steps and not llm.engine.requests


def test_min_tokens_past_the_grammar_end_stops_the_request(llm):
    """min_tokens holds back the EOS a complete grammar allows alone: the token then
    sampled breaks the grammar, and the request stops there instead of failing."""
    spec = StructuredOutputsParams(choice=["ok"])
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=6, structured_outputs=spec)
    out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text.startswith("ok")
    assert len(out.token_ids) <= 6


def test_bitmask_bits_are_tokens_in_xgrammar_order():
    """Bit j of word i is token 32 i + j: our unpacking masks exactly the logits
    xgrammar's own CPU kernel masks."""
    rng = np.random.default_rng(0)
    rows, vocab = 5, 300
    words = torch.from_numpy(rng.integers(-(2**31), 2**31, size=(rows, 10), dtype=np.int32))
    logits = torch.randn(rows, vocab)
    ours = apply_token_bitmask(logits.clone(), words)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, words)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert 0 < int(torch.isinf(ours).sum()) < rows * vocab


@pytest.mark.parametrize("bounded", [True, False])
def test_json_strings_forbid_control_characters_and_surrogates(model_dir, bounded):
    """xgrammar's rule for a string with maxLength admits raw control characters, and
    its string rules admit surrogate code points (bytes ED A0-BF ..): no strict JSON
    parser accepts either; ours narrows both. Byte b is token 3 + b."""
    from transformers import AutoTokenizer

    from batchgen.engine.structured import StructuredOutputs

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    grammar = StructuredOutputs(tok, 512, [2])
    string = {"type": "string", "maxLength": 6} if bounded else {"type": "string"}
    schema = {"type": "object", "properties": {"s": string}, "required": ["s"]}
    grammar.add("r", StructuredOutputsParams(json=schema, disable_any_whitespace=True))

    def allowed() -> set[int]:
        words = grammar.bitmask(["r"])[0].view(np.uint32)
        return {b for b in range(256) if words[(3 + b) // 32] >> ((3 + b) % 32) & 1}

    for b in b'{"s":"a':
        assert grammar.accept("r", 3 + b)
    ok = allowed()
    assert {ord("b"), ord('"'), 0xED, 0xC3} <= ok
    assert not ok & {0x00, 0x05, 0x0A, 0x09, 0x1F}
    assert grammar.accept("r", 3 + 0xED)  # a lead byte of U+D000-U+DFFF
    ok = allowed()
    assert 0x80 in ok and 0x9F in ok  # U+D000-U+D7FF
    assert not ok & set(range(0xA0, 0xC0))  # U+D800-U+DFFF: surrogates


def test_compiled_constraints_are_bounded_and_reused(model_dir):
    from transformers import AutoTokenizer

    from batchgen.engine import structured

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    grammar = structured.StructuredOutputs(tokenizer, 512, [2], compiled_cache=4)
    first = grammar.compile(StructuredOutputsParams(regex="a{1}"))
    assert grammar.compile(StructuredOutputsParams(regex="a{1}")) is first  # by key
    for k in range(2, 8):
        grammar.compile(StructuredOutputsParams(regex=f"a{{{k}}}"))
    assert len(grammar._compiled) == 4
    assert grammar.compile(StructuredOutputsParams(regex="a{1}")) is not first  # dropped


class RowByRow:
    """The reference the batched path must match: each matcher asked one at a time,
    whether it has terminated included, and every step's masks in a fresh array."""

    def __init__(self, grammar) -> None:
        self.grammar = grammar  # its compiled grammars and matchers, none of its state

    def _following(self, request_ids):
        matchers = self.grammar._matchers
        for i, rid in enumerate(request_ids):
            m = matchers.get(rid)
            if m is not None and not m.is_terminated():
                yield i, rid, m

    def constrains(self, request_ids) -> bool:
        return any(True for _ in self._following(request_ids))

    def advance(self, request_ids, token_ids) -> list[str]:
        tokens = dict(zip(request_ids, token_ids))
        return [
            rid for _, rid, m in self._following(request_ids) if not m.accept_token(tokens[rid])
        ]

    def bitmask(self, request_ids, out=None):
        rows = list(self._following(request_ids))
        if not rows:
            return None
        mask = torch.full((len(request_ids), self.grammar.words), -1, dtype=torch.int32)
        for i, _, m in rows:
            m.fill_next_token_bitmask(mask, i)
        if out is None:
            return mask.numpy()
        out[: len(request_ids)] = mask.numpy()
        return out[: len(request_ids)]

    def __getattr__(self, name):  # add, remove, compile, words, ...
        return getattr(self.grammar, name)

    def __contains__(self, rid) -> bool:
        return rid in self.grammar

    def __len__(self) -> int:
        return len(self.grammar)


MIXED = [
    StructuredOutputsParams(json=SCHEMA),
    None,
    StructuredOutputsParams(choice=["yes", "no"]),  # ends after a token or two
    StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{2}"),
    None,
    StructuredOutputsParams(grammar='root ::= "(" item ("," item){0,3} ")"\nitem ::= [xyz]'),
    StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    StructuredOutputsParams(json_object=True),
]


def test_batched_grammar_path_matches_row_by_row(model_dir):
    """A mixed batch (free rows, four kinds of constraint, rows ending early), greedy
    and pipelined: the same tokens whether the masks are filled batched into reused rows
    and matchers are fed without asking each whether it terminated, or row by row."""

    def run(reference: bool):
        llm = LLM(model=str(model_dir), **KW)
        engine = llm.engine
        if reference:
            engine.runner.grammar = engine.grammar = RowByRow(engine._grammar())
        params = [
            SamplingParams(
                temperature=0.0, max_tokens=60 if spec else 5 + i, structured_outputs=spec
            )
            for i, spec in enumerate(MIXED)
        ]
        outs = llm.generate(PROMPTS[: len(MIXED)], params, use_tqdm=False)
        assert len(engine.grammar) == 0
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]

    batched = run(False)
    assert batched == run(True)
    assert batched[2][1] == "stop" and len(batched[2][0]) < len(batched[0][0])


def test_bitmask_rows_match_per_matcher_fills(model_dir):
    """Step by step on a mixed batch, with the rows reused and full of stale words:
    each constrained row is its matcher's own fill, each free or ended row all ones."""
    from transformers import AutoTokenizer

    from batchgen.engine.structured import StructuredOutputs

    grammar = StructuredOutputs(AutoTokenizer.from_pretrained(str(model_dir)), 512, [2])
    reference = RowByRow(StructuredOutputs(AutoTokenizer.from_pretrained(str(model_dir)), 512, [2]))
    ids = [f"r{i}" for i in range(len(MIXED))]
    for rid, spec in zip(ids, MIXED):
        if spec is not None:
            grammar.add(rid, spec)
            reference.add(rid, spec)
    rng = np.random.default_rng(0)
    out = rng.integers(-(2**31), 2**31, size=(len(ids) + 2, grammar.words), dtype=np.int32)
    ended = 0
    for _ in range(80):
        ours = grammar.bitmask(ids, out)
        theirs = reference.bitmask(ids)
        if theirs is None:
            assert ours is None
            break
        assert ours.shape == theirs.shape and np.array_equal(ours, theirs)
        bits = np.unpackbits(theirs.view(np.uint8), axis=1, bitorder="little")[:, :512]
        tokens = [int(rng.choice(np.flatnonzero(row))) for row in bits]  # EOS when allowed
        assert grammar.advance(ids, tokens) == reference.advance(ids, tokens) == []
        ended = sum(1 for rid in ids if rid in grammar._matchers and rid not in grammar._live)
    assert ended > 0  # some rows ended mid-batch and went on unconstrained
    assert grammar.advance(["r0"], [300]) == reference.advance(["r0"], [300])  # one rejected
