"""LLM's progress bar: drawn on a terminal only."""

from __future__ import annotations

import sys

import pytest
from conftest import TtyStream, save_tiny_model

from batchgen import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_model(path, "LlamaForCausalLM")
    return LLM(str(path), device="cpu", dtype="float32", num_kv_pages=32, max_model_len=64)


@pytest.mark.parametrize("tty", [True, False])
def test_the_generating_bar_shows_only_when_stderr_is_a_terminal(monkeypatch, llm, tty):
    stderr = TtyStream(tty)
    monkeypatch.setattr(sys, "stderr", stderr)
    llm.generate(["w5 w6"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=True)
    assert ("Generating" in stderr.getvalue()) is tty
