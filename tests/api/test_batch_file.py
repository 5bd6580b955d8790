"""batch_file: one input line -> a checked request or an error naming the field."""

from __future__ import annotations

import json

import pytest

from batchgen.api import batch_file as bf


def _line(messages, **body) -> bytes:
    row = {
        "custom_id": "c",
        "method": "POST",
        "url": bf.CHAT,
        "body": {"messages": messages, **body},
    }
    return json.dumps(row).encode()


def _user(text: str = "w5") -> dict:
    return {"role": "user", "content": text}


@pytest.mark.parametrize("role", ["bot", "tool", "function", "User", ""])
def test_unknown_chat_role_names_the_field_and_the_allowed_roles(role):
    messages = [{"role": "system", "content": "w3"}, _user(), {"role": role, "content": "w4"}]
    with pytest.raises(bf.LineError) as info:
        bf.parse_line(_line(messages), 1)
    message = str(info.value)
    assert message.startswith("body.messages[2].role must be one of ")
    assert "system, user, assistant, developer" in message
    assert repr(role) in message
    assert info.value.custom_id == "c"


def test_known_chat_roles_are_accepted():
    messages = [
        {"role": "developer", "content": "w3"},
        {"role": "system", "content": "w3"},
        _user(),
        {"role": "assistant", "content": None},
        _user("w6"),
    ]
    item = bf.parse_line(_line(messages), 4)
    assert (item.line, item.custom_id, item.url) == (4, "c", bf.CHAT)


class _TemplateSpy:
    """The two things encode() uses of an LLM, recording what the template receives."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.tokenizer = self

    def apply_chat_template(self, messages):
        self.seen = messages
        return "w5"

    def encode(self, text, add_special_tokens=False):
        return [5]


def test_developer_role_reaches_the_template_as_system():
    spy = _TemplateSpy()
    messages = [{"role": "developer", "content": "w3"}, _user()]
    assert bf.encode(spy, bf.parse_line(_line(messages), 1)) == [5]
    assert [m["role"] for m in spy.seen] == ["system", "user"]


@pytest.mark.parametrize("top", [21, 99, -1])
def test_bad_top_logprobs_is_reported_as_top_logprobs(top):
    body = {"messages": [_user()], "logprobs": True, "top_logprobs": top}
    with pytest.raises(bf.LineError, match=r"^body\.top_logprobs must be .*got") as info:
        bf.sampling_params(body, bf.CHAT, {})
    assert "body.logprobs" not in str(info.value)


def test_good_top_logprobs_and_completion_logprobs():
    body = {"messages": [_user()], "logprobs": True, "top_logprobs": 20}
    assert bf.sampling_params(body, bf.CHAT, {}).logprobs == 20
    with pytest.raises(bf.LineError, match=r"^body\.logprobs must be"):  # its own field
        bf.sampling_params({"prompt": "w5", "logprobs": 21}, bf.COMPLETIONS, {})
