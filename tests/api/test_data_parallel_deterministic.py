"""`batchgen run --deterministic --data-parallel 2`: two engines (Ray actors on a local
cluster), each running its own shards batched its own way, write every line (texts,
finish reasons, logprobs, seeded sampled lines included) as one engine does."""

from __future__ import annotations

import pytest
from test_batch_deterministic import _choices, _lines, twin_model  # noqa: F401 (fixture)
from test_batch_run import _cli, _write_jsonl

from batchgen.api.cli import main


@pytest.mark.slow
def test_data_parallel_1_and_2_write_the_same_lines(tmp_path, twin_model, local_ray):  # noqa: F811
    inp = _write_jsonl(tmp_path / "in.jsonl", _lines())
    det = ("--deterministic", "--max-num-seqs", "8")
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert main(_cli(twin_model, inp, one, *det)) == 0
    dp = ("--data-parallel", "2", "--shard-size", "5")
    assert main(_cli(twin_model, inp, two, *det, *dp)) == 0
    ref = _choices(one)
    assert len(ref) == len(_lines())
    assert _choices(two) == ref
    reasons = {c[0]["finish_reason"] for c in ref.values()}
    assert reasons == {"stop", "length"}  # EOS endings among them
