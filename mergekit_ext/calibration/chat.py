"""Chat examples as the tokenizer's chat template takes them: a list of ``{role, content}``.

Calibration data holds chat in the forms the community publishes it (docs/methods.md,
"Calibration conventions"):

- a text: one user message;
- ``messages`` (OpenAI / TRL "conversational"): ``[{"role": "user", "content": ...}, ...]``;
- ``conversations`` (ShareGPT): ``[{"from": "human", "value": ...}, ...]``, whose roles are
  mapped as TRL maps them (``human`` → ``user``, ``gpt`` → ``assistant``, ``system``).
"""

from __future__ import annotations

from typing import Any

from mergekit_ext.errors import CalibrationError

# The columns that hold conversations, in the order a default `field:` picks them.
CHAT_COLUMNS = ("messages", "conversations")

# ShareGPT's `from` → the chat template's `role` (``user``/``assistant`` pass as they are).
SHAREGPT_ROLES = {
    "human": "user",
    "gpt": "assistant",
    "system": "system",
    "user": "user",
    "assistant": "assistant",
}

EXPECTED = (
    "a text, or a list of messages: {role, content} (OpenAI `messages`) or {from, value} "
    "(ShareGPT `conversations`, from: human | gpt | system)"
)


def is_conversation(item: Any) -> bool:
    """A list (of messages, to be checked by :func:`to_messages`), not a text."""
    return isinstance(item, (list, tuple))


def to_messages(item: Any, where: str) -> list[dict[str, Any]]:
    """The chat-template messages of one calibration example.

    Args:
        item: a text, a list of ``{role, content}`` or a list of ShareGPT ``{from, value}``.
        where: how errors name the example (model, file and row).

    Returns:
        ``[{"role": ..., "content": ...}, ...]`` (other keys of role/content messages kept).

    Raises:
        CalibrationError: an unknown shape or role, naming ``where`` and what is expected.
    """
    if isinstance(item, str):
        return [{"role": "user", "content": item}]
    if not is_conversation(item) or not item:
        got = "an empty list" if is_conversation(item) else f"a {type(item).__name__}"
        raise CalibrationError(f"{where} holds {got}; expected {EXPECTED}")
    messages = []
    for j, message in enumerate(item):
        if not isinstance(message, dict):
            raise CalibrationError(
                f"{where}: message {j} is a {type(message).__name__}; expected {EXPECTED}"
            )
        if message.get("role") is not None and "content" in message:
            messages.append(message)
        elif message.get("from") is not None and "value" in message:
            role = SHAREGPT_ROLES.get(str(message["from"]).lower())
            if role is None:
                raise CalibrationError(
                    f"{where}: message {j} has from: {message['from']!r}; ShareGPT roles are "
                    f"{', '.join(SHAREGPT_ROLES)}"
                )
            messages.append({"role": role, "content": message["value"]})
        else:
            keys = ", ".join(k for k, v in message.items() if v is not None) or "none"
            raise CalibrationError(f"{where}: message {j} has the keys {keys}; expected {EXPECTED}")
    return messages
