"""chat_messages: one check of a conversation for LLM.chat and batch lines, and the
flattened messages the chat template gets."""

from __future__ import annotations

import copy

import pytest
from conftest import save_tiny_model

from batchgen import LLM, SamplingParams
from batchgen.api.chat_messages import ROLES, checked_conversation

ROLE_TEMPLATE = "{% for m in messages %}{{ m['role'] }}={{ m['content'] }};{% endfor %}"
GREEDY = SamplingParams(temperature=0, max_tokens=3)


def _user(text: str = "w5") -> dict:
    return {"role": "user", "content": text}


@pytest.mark.parametrize("prefix", ["", "body.", "conversation 2: "])
@pytest.mark.parametrize("role", ["tool", "function", "bot", "User", ""])
def test_unknown_role_names_the_place_and_the_roles(prefix, role):
    messages = [{"role": "system", "content": "w3"}, {"role": role, "content": "w4"}]
    with pytest.raises(ValueError) as info:
        checked_conversation(messages, prefix)
    assert str(info.value) == (
        f"{prefix}messages[1].role must be one of system, user, assistant, developer, got {role!r}"
    )


@pytest.mark.parametrize(
    "messages, message",
    [
        ("w5", "messages must be a list, got a string"),
        ({"role": "user"}, "messages must be a list, got an object"),
        ([], "messages is empty"),
        ([_user(), "w5"], "messages[1] must be an object with a string role"),
        ([{"content": "w5"}], "messages[0] must be an object with a string role"),
        ([{"role": "user"}], "messages[0].content must be a string or a list of text parts, got null"),
        ([_user(), {"role": "user", "content": 7}], "messages[1].content must be a string or a list of text parts, got a number (7)"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content: only text parts are supported"),
        ([{"role": "user", "content": [{"type": "text", "text": None}]}], "messages[0].content: only text parts are supported"),
    ],
)  # fmt: skip
def test_bad_conversations_name_the_place(messages, message):
    with pytest.raises(ValueError) as info:
        checked_conversation(messages, "body.")
    assert str(info.value) == "body." + message


def test_flattened_for_the_template():
    messages = [
        {"role": "developer", "content": "w3"},
        {"role": "user", "content": [{"type": "text", "text": "w5 "}, {"type": "text", "text": "w6"}]},
        {"role": "assistant", "content": None, "name": "helper"},
        {"role": "system"},
        _user("w7"),
    ]  # fmt: skip
    given = copy.deepcopy(messages)
    flat = checked_conversation(messages)
    assert flat == [
        {"role": "system", "content": "w3"},
        {"role": "user", "content": "w5 w6"},
        {"role": "assistant", "content": "", "name": "helper"},
        {"role": "system", "content": ""},
        {"role": "user", "content": "w7"},
    ]
    assert messages == given
    assert set(ROLES) == {"system", "user", "assistant", "developer"}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat")
    save_tiny_model(path, "LlamaForCausalLM")
    return LLM(str(path), device="cpu", num_kv_pages=32, max_model_len=64)


def _assert_idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished and not llm.engine.requests


def test_chat_takes_openai_text_parts(llm):
    parts = [{"type": "text", "text": "w5 w6 "}, {"type": "text", "text": "w7"}]
    (as_parts,) = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)
    (as_text,) = llm.chat([_user("w5 w6 w7")], GREEDY, use_tqdm=False)
    assert as_parts.prompt_token_ids == as_text.prompt_token_ids
    assert as_parts.outputs[0].token_ids == as_text.outputs[0].token_ids


def test_chat_refuses_an_unknown_role_before_any_work(llm):
    with pytest.raises(ValueError) as info:
        llm.chat([_user(), {"role": "tool", "content": "w4"}], GREEDY, use_tqdm=False)
    assert str(info.value) == (
        "messages[1].role must be one of system, user, assistant, developer, got 'tool'"
    )
    _assert_idle(llm)


def test_chat_names_the_conversation_of_a_bad_message(llm):
    convs = [[_user("w5")], [_user("w6"), {"role": "user"}]]
    with pytest.raises(ValueError, match=r"^conversation 1: messages\[1\]\.content must be"):
        llm.chat(convs, GREEDY, use_tqdm=False)
    _assert_idle(llm)
    outs = llm.chat([[_user("w5")], [_user("w6")]], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]


def test_apply_chat_template_gets_flattened_messages(llm):
    messages = [
        {"role": "developer", "content": "w3"},
        {"role": "user", "content": [{"type": "text", "text": "w5"}]},
        {"role": "assistant", "content": None},
    ]
    text = llm.apply_chat_template(
        messages, add_generation_prompt=False, chat_template=ROLE_TEMPLATE
    )
    assert text == "system=w3;user=w5;assistant=;"


def test_chat_encodes_many_conversations_as_one_at_a_time(llm):
    """LLM.chat renders and encodes its conversations in one batch call each: every
    prompt's ids and text are those of apply_chat_template + encode on it alone, whatever
    their lengths."""
    convs = [
        [_user("w5")],
        [{"role": "system", "content": "w3 w4"}, _user("w5 w6 w7 w8 w9")],
        [_user("w6 w6"), {"role": "assistant", "content": "w7"}, _user("w8")],
    ]
    outs = llm.chat(convs, GREEDY, use_tqdm=False)
    tok = llm.get_tokenizer()
    for conv, out in zip(convs, outs, strict=True):
        text = llm.apply_chat_template(conv)
        assert out.prompt == text
        assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert len({len(o.prompt_token_ids) for o in outs}) == 3
    _assert_idle(llm)
