"""JSON Lines training records: one JSON object a line, read from disk one line at a time.

Two kinds of record:

- text: `{"text": "..."}`, a document trained on in full;
- chat: `{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}`, rendered with the
  model's chat template and trained on the assistant's turns only (edgetrain.data.chat_template).

Blank lines are skipped. Anything else -- a line that is not JSON, not an object, has neither key (or both),
a value of the wrong type, an unknown role, no messages, or no assistant message -- is a JsonlError whose
message starts with "file:line:", raised when the line is read, never skipped.

`edgetrain generate --messages` reads conversations to reply to from the same kind of file (read_chats): one
`{"messages": [...]}` object a line, any roles, no assistant message needed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Union

from edgetrain.data.binary import check_text_file
from edgetrain.data.chat_template import check_messages
from edgetrain.files.user import require_regular_file
from edgetrain.registry import EdgetrainError

ROLES = ("system", "user", "assistant")
Messages = list[dict[str, str]]
Record = Union[str, Messages]  # a text record is its text, a chat record its list of messages


class JsonlError(EdgetrainError, ValueError):
    """A JSONL line that is not a record edgetrain can train on, or that changed after it was indexed; the
    message starts with "file:line:"."""


def _messages(value: object, where: str) -> Messages:
    if not isinstance(value, list):
        raise JsonlError(f"{where}: \"messages\" must be a list of messages, got {type(value).__name__}")
    if not value:
        raise JsonlError(f"{where}: \"messages\" is empty")
    for number, message in enumerate(value):
        if not isinstance(message, dict):
            raise JsonlError(f"{where}: message {number} must be an object, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise JsonlError(f"{where}: message {number} has role {role!r}; known roles: {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise JsonlError(f"{where}: message {number} (role {role}) needs a string \"content\", "
                             f"got {type(content).__name__}")
    if not any(message["role"] == "assistant" for message in value):
        raise JsonlError(f"{where}: the chat has no assistant message, so nothing to learn (the loss is on "
                         "assistant turns only)")
    return value


def _json_object(line: bytes, where: str) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except UnicodeDecodeError as exc:
        raise JsonlError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise JsonlError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(value, dict):
        raise JsonlError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def parse_record(line: bytes, where: str) -> Record:
    """The record on one line (`where` is "file:line", for messages)."""
    value = _json_object(line, where)
    if ("text" in value) == ("messages" in value):
        keys = ", ".join(map(repr, value)) or "none"
        raise JsonlError(f"{where}: a record needs exactly one of \"text\" or \"messages\" (keys: {keys})")
    if "text" in value:
        if not isinstance(value["text"], str):
            raise JsonlError(f"{where}: \"text\" must be a string, got {type(value['text']).__name__}")
        return value["text"]
    return _messages(value["messages"], where)


def parse_chat(line: bytes, where: str) -> dict[str, Any]:
    """The conversation on one line, to reply to: a JSON object whose "messages" is a chat (checked by
    edgetrain.data.chat_template.check_messages, a ChatMessageError naming `where`); its other keys are kept."""
    value = _json_object(line, where)
    if "messages" not in value:
        keys = ", ".join(map(repr, value)) or "none"
        raise JsonlError(f"{where}: a conversation needs a \"messages\" list (keys: {keys})")
    return {**value, "messages": check_messages(value["messages"], where)}


def read_chats(path: str | Path) -> list[dict[str, Any]]:
    """Every conversation of a JSONL file (parse_chat), all read and checked before any is used, so that a
    bad line is named before the first reply is written. An empty file is a JsonlError."""
    path = require_regular_file(path, JsonlError, "the conversations file")
    chats = [parse_chat(line, f"{path}:{number}") for number, _, line in iter_lines(path)]
    if not chats:
        raise JsonlError(f"{path}: no conversations (one {{\"messages\": [...]}} object a line)")
    return chats


def iter_lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """(line number from 1, byte offset, raw bytes) of each non-blank line of `path`, read one at a time. A
    file that is not text is a BinaryInputError (edgetrain.data.binary) before its first line: checked whole
    first (one quick read, next to tokenising every record), so that binary data is named as such rather than
    as a line that is not JSON."""
    check_text_file(path)
    offset = 0
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield number, offset, line
            offset += len(line)


def read_line(path: Path, offset: int) -> bytes:
    """The line of `path` that starts at byte `offset` (the file is opened for this read only)."""
    with open(path, "rb") as handle:
        handle.seek(offset)
        return handle.readline()
