"""What reaches the terminal besides batchgen's own logs and results.

Progress bars are for people watching a terminal: `progress_enabled()` is true only while
stderr is a terminal and no `quiet_libraries(quiet=True)` scope is active. Every bar
batchgen draws asks it, and `library_progress_bars(enabled)` applies the same answer to
the bars transformers draws while it loads (its own and the GGUF de-quantization bar).

`quiet_libraries(quiet)` is the command line's scope: inside it other libraries log
errors only and their Python warnings are dropped (batchgen never uses `warnings`), so a
run prints batchgen's logs and nothing else. Each scope puts back what it changed when
it exits: the Python API's callers keep their own logging and progress-bar settings.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

_quiet = False  # set inside quiet_libraries(quiet=True)


def progress_enabled() -> bool:
    """Whether a progress bar may be drawn now: stderr is a terminal and not --quiet."""
    if _quiet:
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except ValueError:  # a closed stream
        return False


@contextmanager
def library_progress_bars(enabled: bool) -> Iterator[None]:
    """Within: transformers draws progress bars only if `enabled`. Its GGUF loader draws
    one with tqdm directly, not through transformers' progress-bar switch, so that name
    is swapped for a disabled tqdm for the duration; both are put back on exit."""
    if enabled:
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    bar = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextmanager
def quiet_libraries(quiet: bool = False) -> Iterator[None]:
    """Within: transformers logs errors only, Python warnings are not shown, and with
    `quiet` no progress bar is drawn (progress_enabled() is false)."""
    global _quiet
    from transformers.utils import logging as hf_logging

    was_quiet, level = _quiet, hf_logging.get_verbosity()
    _quiet = was_quiet or quiet
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        _quiet = was_quiet
