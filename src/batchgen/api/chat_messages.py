"""Chat messages: one check for every path that takes a conversation (LLM.chat, batch
lines), and the flattened form the chat template gets.

A conversation is a non-empty list of messages `{"role": ..., "content": ...}`:
- role is one of ROLES; "developer" (OpenAI's newer name for the system message)
  reaches the template as "system", the role templates know. "tool" and "function" are
  refused: a tool result needs the assistant's tool call and the tools list, which
  neither path passes to the template.
- content is a string or a list of OpenAI text parts `{"type": "text", "text": ...}`
  (joined into one string for the template); a message other than the user's may have
  null or no content (an assistant turn that only called a tool), which reaches the
  template as "".
Other keys of a message (name, ...) reach the template unchanged.
"""

from __future__ import annotations

from typing import Any

ROLES = ("system", "user", "assistant", "developer")
_TEMPLATE_ROLE = {"developer": "system"}


def checked_conversation(messages: Any, prefix: str = "") -> list[dict[str, Any]]:
    """`messages` checked and flattened for the chat template.

    Raises ValueError naming the place, `prefix` first: with prefix "body." a bad role
    reads `body.messages[1].role must be one of system, user, assistant, developer, got
    'tool'`. The messages given are not changed.
    """
    where = f"{prefix}messages"
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"{where} must be a list, got {json_type(messages)}")
    if not messages:
        raise ValueError(f"{where} is empty")
    return [_checked_message(m, f"{where}[{i}]") for i, m in enumerate(messages)]


def _checked_message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"{where} must be an object with a string role")
    role = message["role"]
    if role not in ROLES:
        raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
    content = message.get("content")
    if isinstance(content, list):
        if not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            raise ValueError(f"{where}.content: only text parts are supported")
        content = "".join(p["text"] for p in content)
    elif content is None and role != "user":
        content = ""
    elif not isinstance(content, str):
        raise ValueError(
            f"{where}.content must be a string or a list of text parts, got {json_type(content)}"
        )
    return {**message, "role": _TEMPLATE_ROLE.get(role, role), "content": content}


def json_type(v: Any) -> str:
    """What a decoded JSON value is, for error messages ("an array", "a number (3)")."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return f"a number ({v!r})"
    if isinstance(v, str):
        return "an empty string" if not v else "a string"
    if isinstance(v, list):
        return "an array"
    return "an object" if isinstance(v, dict) else type(v).__name__
