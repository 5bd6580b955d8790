"""ShardWorker without Ray: shards share one engine, results come back in input order,
a refused line is an error record, and an engine error fails every shard after it."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from batchgen import LLM, SamplingParams
from batchgen.api import batch_file as bf
from batchgen.api import batch_output as bo
from batchgen.api.batch_job import JobOptions
from batchgen.api.shard_worker import Shard, ShardWorker


def _worker(model: str) -> ShardWorker:
    opts = JobOptions(input=Path("in.jsonl"), output=Path("out.jsonl"), model_name="tiny")
    engine = {"device": "cpu", "kv_cache_size_gib": 0.02, "max_num_seqs": 4}
    return ShardWorker(model, engine, opts)


def _item(line: int, words: str, max_tokens: int) -> bf.BatchItem:
    body = {"prompt": words, "max_tokens": max_tokens, "temperature": 0}
    return bf.BatchItem(line, f"c{line}", bf.COMPLETIONS, body)


def _run_all(worker: ShardWorker, shards: list[Shard]) -> list:
    """Run the shards at once, one thread each, as Ray's threaded actor calls them."""
    results: list = [None] * len(shards)

    def call(i: int) -> None:
        try:
            results[i] = worker.run_shard(shards[i])
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def test_shards_share_the_engine_and_come_back_in_input_order(tiny_llama):
    worker = _worker(tiny_llama)
    shards = [
        Shard(0, [_item(1, "w5 w6", 12), _item(2, "w7", 2), _item(3, "w9 " * 1100, 2)]),
        Shard(1, [_item(4, "w8", 3), _item(5, "w10 w11", 1)]),
    ]
    first, second = _run_all(worker, shards)
    assert [line for line, _ in first.outputs] == [1, 2]  # sorted, though 2 ends first
    assert [line for line, _ in first.errors] == [3]
    error = json.loads(first.errors[0][1])
    assert error["custom_id"] == "c3" and "max_model_len" in error["error"]["message"]
    assert [line for line, _ in second.outputs] == [4, 5]
    # each shard's token totals are its own requests' only, counted here by a plain
    # engine generating the same prompts (the refused line counts nothing)
    prompts = {1: ("w5 w6", 12), 2: ("w7", 2), 4: ("w8", 3), 5: ("w10 w11", 1)}
    plain = LLM(tiny_llama, device="cpu", kv_cache_size_gib=0.02, max_num_seqs=4)
    counted = {}
    for line, (words, max_tokens) in prompts.items():
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        (out,) = plain.generate([words], params, use_tqdm=False)
        counted[line] = (len(out.prompt_token_ids), len(out.outputs[0].token_ids))
    for result, lines in ((first, (1, 2)), (second, (4, 5))):
        assert result.prompt_tokens == sum(counted[line][0] for line in lines)
        assert result.completion_tokens == sum(counted[line][1] for line in lines)


@pytest.mark.parametrize("where", ["step", "output_line"])
def test_after_an_engine_error_every_shard_fails(tiny_llama, monkeypatch, where):
    """An error in the engine thread, in a step or while making a result line, fails
    the shards in flight and every later one; no call waits forever."""
    worker = _worker(tiny_llama)

    def broken(*args):
        raise RuntimeError("the device fell over")

    if where == "step":
        monkeypatch.setattr(worker.llm.engine, "step", broken)
    else:
        monkeypatch.setattr(bo, "output_line", broken)
    results = _run_all(worker, [Shard(0, [_item(1, "w5", 2)]), Shard(1, [_item(2, "w6", 2)])])
    assert all(isinstance(r, RuntimeError) for r in results), results
    (later,) = _run_all(worker, [Shard(2, [_item(3, "w7", 2)])])
    assert "the device fell over" in str(later)
