"""What reaches the terminal besides batchgen's own logs and results.

Progress bars are for people watching a terminal: `progress_enabled()` is true only while
stderr is a terminal and no `quiet_libraries(quiet=True)` scope is active. Every bar
batchgen draws asks it, and `library_progress_bars(enabled)` applies the same answer to
the bars transformers draws while it loads (its own and the GGUF de-quantization bar).

`quiet_libraries(quiet)` is the command line's scope: inside it other libraries log
errors only and their Python warnings are dropped (batchgen never uses `warnings`), so a
run prints batchgen's logs and nothing else. Each scope puts back what it changed when
it exits: the Python API's callers keep their own logging and progress-bar settings.

`command_logging(quiet)` is where the command's own logs go: stderr, each line with its
time, level and logger, except a usage error (logged with `usage_error`), which reads
as argparse's own do: `batchgen run: error: --tp must be >= 1, got 0`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
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


_USAGE_OF = "batchgen_usage_of"  # a usage error's record: the command it is about


def usage_error(logger: logging.Logger, command: str, message: str) -> None:
    """Log `message` as a usage error of `command` ("batchgen run"): under
    command_logging it reads `batchgen run: error: message`, without time or level."""
    logger.error(message, extra={_USAGE_OF: command}, stacklevel=2)


class _CommandFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        command = getattr(record, _USAGE_OF, None)
        if command is not None:
            return f"{command}: error: {record.getMessage()}"
        return super().format(record)


@contextmanager
def command_logging(quiet: bool, libraries: bool = True) -> Iterator[None]:
    """Within: batchgen's records from INFO (errors only with `quiet`) reach stderr,
    other libraries' from ERROR; with `libraries`, inside quiet_libraries(quiet) as
    well (it imports transformers: a command that loads no model leaves it out). The
    handler goes to the root logger only where the program has none of its own (as
    logging.basicConfig does), and stays; the levels are put back on exit (the command
    may run inside another program)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_CommandFormatter())
    logging.basicConfig(handlers=[handler])
    loggers = [logging.getLogger(), logging.getLogger("batchgen")]
    old = [lg.level for lg in loggers]
    loggers[0].setLevel(logging.ERROR)
    loggers[1].setLevel(logging.ERROR if quiet else logging.INFO)
    try:
        with quiet_libraries(quiet) if libraries else contextlib.nullcontext():
            yield
    finally:
        for lg, level in zip(loggers, old):
            lg.setLevel(level)
