"""batch_file: one input line -> a checked request or an error naming the field."""

from __future__ import annotations

import json

import pytest

from batchgen.api import batch_file as bf
from batchgen.api import batch_output as bo


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


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"response_format": {"type": "json_object"}}, ("json_object", None, False)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA},
                }
            },
            ("json", json.dumps(SCHEMA, sort_keys=True), False),
        ),
        ({"guided_json": SCHEMA}, ("json", json.dumps(SCHEMA, sort_keys=True), False)),
        ({"guided_regex": "[0-9]+"}, ("regex", "[0-9]+", False)),
        ({"guided_choice": ["a", "b"]}, ("choice", ("a", "b"), False)),
        ({"guided_grammar": 'root ::= "x"'}, ("grammar", 'root ::= "x"', False)),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
            ("json_object", None, True),
        ),
    ],
)
def test_output_constraints_from_openai_and_vllm_fields(body, expected):
    params = bf.sampling_params({"prompt": "w5", **body}, bf.COMPLETIONS, {})
    assert params.structured_outputs.key == expected


def test_text_response_format_is_no_constraint():
    body = {"prompt": "w5", "response_format": {"type": "text"}}
    assert bf.sampling_params(body, bf.COMPLETIONS, {}).structured_outputs is None


@pytest.mark.parametrize(
    "body, message",
    [
        ({"response_format": {"type": "xml"}}, "body.response_format: type must be"),
        (
            {"response_format": {"type": "json_schema"}},
            "body.response_format: .*json_schema.schema",
        ),
        ({"response_format": "json"}, "body.response_format: type must be"),
        ({"guided_choice": []}, "body.guided_choice: choice must be a non-empty list"),
        ({"guided_json": "{bad"}, "body.guided_json: json is not valid JSON"),
        ({"structured_outputs": {"color": 1}}, "body.structured_outputs: .*color"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "more than one output constraint: response_format, guided_regex",
        ),
    ],
)
def test_bad_output_constraints_name_the_field(body, message):
    with pytest.raises(bf.LineError, match=message):
        bf.sampling_params({"prompt": "w5", **body}, bf.COMPLETIONS, {})


def test_unknown_body_key_names_the_nearest_known_one():
    with pytest.raises(
        bf.LineError, match=r"unknown body field 'max_token'; did you mean 'max_tokens'"
    ):
        bf.parse_line(_line([_user()], max_token=5), 1)
    plain = json.dumps({"id": "p", "prompt": "w5", "temprature": 0}).encode()
    with pytest.raises(bf.LineError, match=r"'temprature'; did you mean 'temperature'"):
        bf.parse_line(plain, 1)


def test_keys_openai_accepts_are_ignored_or_refused_by_what_they_would_change():
    item = bf.parse_line(_line([_user()], user="u1", store=False, metadata={"a": "b"}), 1)
    assert item.ignored == ("user", "store", "metadata")
    assert bf.parse_line(_line([_user()], tools=[]), 1).ignored == ()  # empty: no effect
    with pytest.raises(bf.LineError, match=r"body\.logit_bias is not supported"):
        bf.parse_line(_line([_user()], logit_bias={"5": 10}), 1)


def test_a_byte_order_mark_on_line_one_is_skipped():
    raw = bf.BOM + _line([_user()])
    assert bf.parse_line(raw, 1).custom_id == "c"
    with pytest.raises(bf.LineError, match="malformed JSON"):
        bf.parse_line(raw, 2)  # a BOM anywhere else is not whitespace


@pytest.mark.parametrize("cid", [7, "", ["a"]])
def test_an_error_record_shows_the_custom_id_the_line_had(cid):
    row = {"custom_id": cid, "method": "POST", "url": bf.CHAT, "body": {"messages": [_user()]}}
    with pytest.raises(bf.LineError) as info:
        bf.parse_line(json.dumps(row).encode(), 3)
    record = bo.error_line(3, info.value.record_id, str(info.value))
    assert record["custom_id"] == cid
    assert info.value.custom_id is None  # not a custom_id for duplicate detection
