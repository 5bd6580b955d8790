"""`batchgen eval` help texts render as written (argparse's % escapes included)."""

from __future__ import annotations

import argparse

from batchgen.api.cli import build_parser


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_no_help_text_shows_an_escaped_percent_sign():
    helps = {p.prog: p.format_help() for p in _parsers(build_parser())}
    assert "batchgen eval mc" in helps
    assert {prog: h for prog, h in helps.items() if "%%" in h} == {}
    assert "95% Wilson interval" in " ".join(helps["batchgen eval mc"].split())
