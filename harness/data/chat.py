"""Conversations as DFlash trainers take them: read, normalise to ``{role, content}`` turns, check, trim.

Two schemas, in JSON lines, parquet or a ``save_to_disk`` directory:

- OpenAI style: ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}``;
- ShareGPT style: ``{"conversations": [{"from": "system"|"human"|"gpt", "value": ...}, ...]}``.

Every problem is named by row (and turn) with its fix: an unknown role, empty content, no assistant turn,
a turn that is not an object. A conversation that does not end with an assistant turn follows
``data.incomplete``: ``trim`` (drop the turns after the last assistant turn, counted), ``drop`` (leave the
conversation out, counted) or ``error``. Nothing is dropped silently: :class:`ChatRows` counts every
conversation trimmed or left out.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.data.errors import DataValidationError

#: the column of each schema, and the keys of its turns
SCHEMAS = {"messages": ("role", "content"), "conversations": ("from", "value")}
#: every role name either schema uses, to the role a chat template expects
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant"}
INCOMPLETE_CHOICES = ("trim", "drop", "error")
READ_BATCH_ROWS = 1000


class ConversationError(DataValidationError):
    """A conversation the chat path cannot use (named by row and turn)."""


@dataclass
class ChatRows:
    """The conversations a source holds, normalised: ``(where, turns)`` in order, and what was changed."""

    rows: list[tuple[str, list[dict[str, str]]]] = field(default_factory=list)  # (row 3 / line 4, turns)
    trimmed: int = 0  # conversations whose trailing non-assistant turns were dropped (data.incomplete=trim)
    dropped: int = 0  # conversations left out (data.incomplete=drop)
    schema: str = ""

    def words(self) -> str:
        changed = [f"{count} {what}" for count, what in ((self.trimmed, "trimmed after their last assistant turn"),
                                                          (self.dropped, "without a final assistant turn dropped"))
                   if count]
        return f"{len(self.rows)} conversations ({self.schema})" + (f", {', '.join(changed)}" if changed else "")


def conversation_column(names: list[str]) -> str | None:
    """``messages`` or ``conversations`` when exactly one of them is a column; None when neither is."""
    found = [name for name in SCHEMAS if name in names]
    if len(found) > 1:
        raise ConversationError(f"columns {found}: both conversation schemas are present; keep one column")
    return found[0] if found else None


def read_conversations(path: Path, split: str | None, incomplete: str) -> ChatRows:
    """Every conversation of ``path`` (JSON lines, parquet or a save_to_disk directory), checked and normalised."""
    if incomplete not in INCOMPLETE_CHOICES:
        raise ConversationError(f"data.incomplete={incomplete!r}: choose one of {list(INCOMPLETE_CHOICES)}")
    records, column = _records(path, split)
    out = ChatRows(schema="OpenAI messages" if column == "messages" else "ShareGPT conversations")
    for where, value in records:
        turns = normalise(value, f"{path}: {where}", column)
        last_assistant = max((i for i, turn in enumerate(turns) if turn["role"] == "assistant"), default=None)
        if last_assistant is None:
            raise ConversationError(f"{path}: {where}: no assistant turn, so nothing to train on; give each "
                                    "conversation at least one assistant reply (or remove the row)")
        if last_assistant != len(turns) - 1:
            if incomplete == "error":
                raise ConversationError(
                    f"{path}: {where}: ends with a {turns[-1]['role']} turn, not an assistant reply; set "
                    "data.incomplete=trim (drop the turns after the last reply) or data.incomplete=drop")
            if incomplete == "drop":
                out.dropped += 1
                continue
            turns = turns[:last_assistant + 1]
            out.trimmed += 1
        out.rows.append((where, turns))
    if not out.rows:
        raise ConversationError(f"{path}: no conversation is left ({out.dropped} dropped by data.incomplete=drop)")
    return out


def normalise(value: Any, where: str, column: str) -> list[dict[str, str]]:
    """One conversation's turns as ``{"role", "content"}`` with the template's role names (``where``: ``row 3``,
    or ``line 4`` of a JSON-lines file)."""
    role_key, content_key = SCHEMAS[column]
    if isinstance(value, str):  # a column of JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ConversationError(f"{where}: {column} is text that is not JSON; give a list of turns") from None
    if not isinstance(value, list) or not value:
        raise ConversationError(f"{where}: {column} is {type(value).__name__ if value else 'empty'}; give a "
                                f"non-empty list of turns like {{{role_key!r}: ..., {content_key!r}: ...}}")
    turns = []
    for index, turn in enumerate(value):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise ConversationError(f"{where}, turn {index}: give an object with {role_key!r} and {content_key!r} "
                                    f"(found {json.dumps(turn)[:80]})")
        role = ROLES.get(str(turn[role_key]).strip().lower())
        if role is None:
            raise ConversationError(f"{where}, turn {index}: unknown role {turn[role_key]!r}; use one of "
                                    f"{sorted(ROLES)}")
        content = turn[content_key]
        if not isinstance(content, str) or not content.strip():
            raise ConversationError(f"{where}, turn {index} ({role}): empty content; give the turn's text or "
                                    "remove the turn")
        turns.append({"role": role, "content": content})
    return turns


def _records(path: Path, split: str | None) -> tuple[Iterator[tuple[str, Any]], str]:
    """``(where, conversation value)`` of every row (``row 3``; ``line 4`` of a JSON-lines file) and the column."""
    if path.is_dir():
        import datasets

        from harness.data.lengths import select_split

        dataset, _ = select_split(datasets.load_from_disk(str(path)), split, path, ConversationError,
                                  option="data.split", drop_fix="; set data.split to null")
        column = _column_or_error(path, dataset.column_names)
        values = dataset.select_columns([column])
        return ((f"row {row}", item[column]) for row, item in enumerate(values)), column
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        column = _column_or_error(path, parquet.schema_arrow.names)

        def parquet_rows() -> Iterator[tuple[str, Any]]:
            row = 0
            for batch in parquet.iter_batches(columns=[column], batch_size=READ_BATCH_ROWS):
                for value in batch.column(0).to_pylist():
                    yield f"row {row}", value
                    row += 1
        return parquet_rows(), column
    first = _first_json_object(path)
    column = _column_or_error(path, list(first))

    def json_rows() -> Iterator[tuple[str, Any]]:
        with path.open() as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ConversationError(f"{path}: line {number} is not valid JSON: {err.msg} at column "
                                            f"{err.colno}") from None
                if not isinstance(record, dict) or column not in record:
                    raise ConversationError(f"{path}: line {number} has no {column!r} key; give every line the "
                                            "same schema")
                yield f"line {number}", record[column]
    return json_rows(), column


def _first_json_object(path: Path) -> dict:
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ConversationError(f"{path}: line {number} is not valid JSON: {err.msg}") from None
                if not isinstance(record, dict):
                    raise ConversationError(f"{path}: line {number} is not a JSON object")
                return record
    raise ConversationError(f"{path}: the file is empty; give one conversation per line")


def _column_or_error(path: Path, names: list[str]) -> str:
    column = conversation_column(names)
    if column is None:
        raise ConversationError(f"{path}: no 'messages' or 'conversations' column (columns: {names}); give "
                                "conversations in the OpenAI or ShareGPT schema, or data.format=tokenized with "
                                "input_ids")
    return column
