"""batch_output: a finished line's OpenAI-shaped answer."""

from __future__ import annotations

import pytest

from batchgen.api import batch_file as bf
from batchgen.api import batch_output as bo


class _Pieces:
    """A tokenizer whose token t decodes to "<t>"."""

    def decode(self, ids):
        return "".join(f"<{t}>" for t in ids)


def _finished_request(finish_reason: str, stop_reason, include_stop: bool = False):
    from batchgen.engine.request import Request
    from batchgen.runner.batch import TokenLogprobs
    from batchgen.sampling_params import SamplingParams

    params = SamplingParams(logprobs=1, include_stop_str_in_output=include_stop)
    req = Request("1", [3, 4], params, max_tokens=8)
    for t in (10, 11, 2):  # 2: the EOS
        req.append_token(t)
        req.logprobs.append(TokenLogprobs(-0.5, 1, [(t, -0.5)]))
    req.finish_reason, req.stop_reason, req.text = finish_reason, stop_reason, "<10><11>"
    return req


@pytest.mark.parametrize(
    "finish_reason, stop_reason, expected",
    [
        ("stop", None, ["<10>", "<11>"]),
        ("stop", 2, ["<10>", "<11>"]),
        ("length", None, ["<10>", "<11>", "<2>"]),
    ],
)
def test_chat_logprobs_cover_the_returned_content_only(finish_reason, stop_reason, expected):
    req = _finished_request(finish_reason, stop_reason)
    pending = bo.Pending(1, "c", bf.CHAT, 1, samples=[req])
    body = bo.output_line(pending, "m", _Pieces())["response"]["body"]
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == expected
    assert body["usage"]["completion_tokens"] == 3  # usage still counts the EOS
