"""A data-parallel shard worker (without Ray) runs lines of n samples as one line, and
fails a line its engine fails alone (RequestsFailed) while the rest of its shard runs."""

from __future__ import annotations

import json

from test_shard_worker import _worker

from batchgen.api import batch_file as bf
from batchgen.api.shard_worker import Shard
from batchgen.engine.engine_core import EngineCore, RequestsFailed


def _item(line: int, max_tokens: int, **body) -> bf.BatchItem:
    body = {"prompt": f"w{5 + line} w9", "max_tokens": max_tokens, "ignore_eos": True, **body}
    return bf.BatchItem(line, f"c{line}", bf.COMPLETIONS, body, digest=f"d{line}")


def test_a_shard_of_n_sample_lines_and_a_failed_request(tiny_llama, monkeypatch):
    real_step = EngineCore.step
    steps = []

    def step(self):
        """Line 2's request fails in the third step, as a grammar error would."""
        steps.append(1)
        if len(steps) == 3 and "2" in self.requests:
            self.abort(["2"])
            raise RequestsFailed({"2": RuntimeError("planted")})
        return real_step(self)

    monkeypatch.setattr(EngineCore, "step", step)
    worker = _worker(tiny_llama)
    shard = Shard(0, [_item(1, 5, n=3), _item(2, 20), _item(3, 4)])
    result = worker.run_shard(shard)
    assert [line for line, _ in result.outputs] == [1, 3]
    three = json.loads(result.outputs[0][1])["response"]["body"]
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert three["usage"]["completion_tokens"] == 3 * 5
    assert result.completion_tokens == 3 * 5 + 4
    ((line, raw),) = result.errors
    error = json.loads(raw)
    assert line == 2 and error["custom_id"] == "c2"
    assert error["error"]["code"] == "engine_error" and "planted" in error["error"]["message"]
    assert error["error"]["line_digest"] == "d2"
