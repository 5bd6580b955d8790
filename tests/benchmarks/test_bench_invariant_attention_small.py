"""benchmarks/bench_invariant_attention.py --small: every case runs on the CPU (the
interpreter) and prints one line a case, with the plain kernel beside it where one
compares."""

from __future__ import annotations

from bench_scripts import load


def test_small_run_prints_every_case(capsys):
    assert load("bench_invariant_attention").main(["--small"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [
        ["gqa", "decode"],
        ["gqa", "prefill"],
        ["mla", "decode"],
        ["mla", "prefill"],
    ]
    assert all("x plain" in line for line in lines[:3]) and lines[3].endswith("-")
