"""console.py: progress bars only on a terminal and never under --quiet; library noise
scoped to the command line and put back afterwards."""

from __future__ import annotations

import io
import logging
import sys
import warnings

import pytest
from conftest import TtyStream
from transformers import modeling_gguf_pytorch_utils as gguf_utils
from transformers.utils import logging as hf_logging

from batchgen import console


@pytest.mark.parametrize("tty", [True, False])
def test_progress_only_on_a_terminal_and_never_when_quiet(monkeypatch, tty):
    monkeypatch.setattr(sys, "stderr", TtyStream(tty))
    assert console.progress_enabled() is tty
    with console.quiet_libraries(quiet=False):
        assert console.progress_enabled() is tty
    with console.quiet_libraries(quiet=True):
        assert not console.progress_enabled()
    assert console.progress_enabled() is tty


def _gguf_bar_output() -> str:
    out = io.StringIO()
    for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing", file=out):
        pass
    return out.getvalue()


def test_library_progress_bars_off_silences_the_gguf_bar_and_puts_it_back():
    assert "de-quantizing" in _gguf_bar_output()
    enabled = hf_logging.is_progress_bar_enabled()
    with console.library_progress_bars(False):
        assert _gguf_bar_output() == ""
        assert not hf_logging.is_progress_bar_enabled()
    assert "de-quantizing" in _gguf_bar_output()
    assert hf_logging.is_progress_bar_enabled() == enabled
    with console.library_progress_bars(True):
        assert "de-quantizing" in _gguf_bar_output()


def test_quiet_libraries_drops_library_warnings_and_puts_everything_back():
    level, filters = hf_logging.get_verbosity(), list(warnings.filters)
    with console.quiet_libraries():
        assert hf_logging.get_verbosity() == logging.ERROR
        with warnings.catch_warnings(record=True) as seen:
            warnings.warn("library noise", FutureWarning, stacklevel=1)
        assert seen == []
    assert hf_logging.get_verbosity() == level
    assert warnings.filters == filters
