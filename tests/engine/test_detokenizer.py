"""Incremental detokenization for stop strings: the text built a few ids at a time
equals the whole output's decode, on a byte-level BPE tokenizer (partial UTF-8
characters, leading spaces) and on the WordLevel test tokenizer."""

from __future__ import annotations

import random

import pytest
from conftest import save_tiny_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from batchgen.engine.detokenizer import Detokenizer
from batchgen.engine.request import Request
from batchgen.sampling_params import SamplingParams

TEXT = (
    "Grüße aus Köln! 東京タワー is 333 m tall; naïve café — ünïcödé, emoji 🙂🚀 and "
    "plain words with spaces, tabs\tand\nnewlines. "
) * 4


def _byte_level_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _grow(detok: Detokenizer, ids: list[int], stop: list[str]) -> Request:
    req = Request("r", [1], SamplingParams(stop=stop), 10_000)
    for t in ids:
        req.output_token_ids.append(t)
        if detok.find_stop(req) is not None:
            break
    return req


def _detokenizer(tok, stream: bool) -> Detokenizer:
    """The DecodeStream path, or the decode-a-window fallback (tokenizers without it)."""
    detok = Detokenizer(tok)
    assert detok._rust is not None
    if not stream:
        detok._rust = None
    return detok


@pytest.mark.parametrize("stream", [True, False])
def test_incremental_text_equals_the_whole_decode(stream):
    tok = _byte_level_bpe()
    detok = _detokenizer(tok, stream)
    ids = tok.encode(TEXT)
    assert len(ids) > 100
    req = _grow(detok, ids, ["<never>"])
    assert req.text == tok.decode(ids)
    # random id sequences too (byte tokens alone: partial characters everywhere)
    rng = random.Random(0)
    for _ in range(5):
        ids = [rng.randrange(len(tok)) for _ in range(200)]
        whole = tok.decode(ids)
        req = _grow(detok, ids, ["<never>"])
        assert whole.startswith(req.text) and len(whole) - len(req.text) <= 1


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_is_found_at_the_token_completing_it(include, stream):
    tok = _byte_level_bpe()
    ids = tok.encode(TEXT)
    params = SamplingParams(stop=["café", "🚀"], include_stop_str_in_output=include)
    req = Request("r", [1], params, 10_000)
    detok = _detokenizer(tok, stream)
    stop = None
    for t in ids:
        req.output_token_ids.append(t)
        stop = detok.find_stop(req)
        if stop is not None:
            break
    n = len(req.output_token_ids)
    assert stop == "café"  # it comes before the first rocket
    assert "café" in tok.decode(ids[:n]) and "café" not in tok.decode(ids[: n - 1])
    at = TEXT.find("café")
    assert req.text == (TEXT[: at + len("café")] if include else TEXT[:at])


@pytest.mark.parametrize("stream", [True, False])
def test_word_level_tokenizer(tmp_path, stream):
    save_tiny_model(tmp_path, "LlamaForCausalLM")
    tok = AutoTokenizer.from_pretrained(tmp_path)
    rng = random.Random(1)
    ids = [rng.randrange(3, 500) for _ in range(60)]
    req = _grow(_detokenizer(tok, stream), ids, ["<never>"])
    assert req.text == tok.decode(ids)


@pytest.mark.parametrize("kind", ["byte-level-bpe", "word-level"])
def test_direct_decode_equals_transformers_decode(tmp_path, kind):
    """The backend's decode, which a fast tokenizer that cleans up no spaces goes
    through, gives transformers' text, special tokens kept or skipped."""
    if kind == "byte-level-bpe":
        tok = _byte_level_bpe()
        tok.add_special_tokens({"eos_token": "<|end|>"})
    else:
        save_tiny_model(tmp_path, "LlamaForCausalLM")
        tok = AutoTokenizer.from_pretrained(tmp_path)
    detok = Detokenizer(tok)
    assert tok.clean_up_tokenization_spaces is False and detok._direct is not None
    rng = random.Random(2)
    special = tok.all_special_ids
    assert special, "the test needs a tokenizer with special tokens"
    for skip in (False, True):
        req = Request("r", [1], SamplingParams(skip_special_tokens=skip), 10_000)
        for _ in range(5):
            ids = [rng.randrange(len(tok)) for _ in range(80)] + special
            rng.shuffle(ids)
            want = tok.decode(ids, skip_special_tokens=skip)
            assert detok.decode(req, ids) == want
            req.output_token_ids = ids
            detok.finalize(req)
            assert req.text == want


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers():
    """transformers' clean-up (" ." -> "." and the like) is kept where the tokenizer asks
    for it: such a tokenizer is not decoded through its backend."""
    vocab = {"[UNK]": 0, "hello": 1, ".": 2, "world": 3, ",": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=True)
    detok = Detokenizer(tok)
    assert detok._direct is None
    req = Request("r", [1], SamplingParams(), 10_000)
    ids = [1, 4, 3, 2]
    assert backend.decode(ids) == "hello , world ."  # what the backend alone gives
    assert detok.decode(req, ids) == tok.decode(ids) == "hello, world."
