"""Conversations to training samples with the target's own chat template: ``input_ids`` and a loss mask on
the assistant's tokens only.

The tokenizer is a local Hugging Face tokenizer directory (``data.tokenizer``) and the template its own
(``apply_chat_template``). The mask comes from the template's ``{% generation %}`` markers where it has
them (``return_assistant_tokens_mask``); otherwise the conversation is rendered turn by turn: an
assistant turn's tokens are those its rendering adds after the rendering of the turns before it with the
generation prompt (so the role header is not trained on), and every step must extend the one before
it and the last must equal the whole conversation's rendering, or the conversation is refused naming
the row. Which of the two was used is recorded (:attr:`ChatTokenizer.method`).

The result is cached like the other sources: one Arrow file of ``input_ids`` and ``loss_mask``, keyed by
the conversations' file, the tokenizer's files (its template included), ``data.incomplete`` and
``data.bad_rows``. A conversation the template refuses (e.g. roles that do not alternate) is a bad row
like those :mod:`harness.data.chat` finds: all of them are reported together, or dropped and counted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness.data import cache
from harness.data.chat import (
    TEMPLATE_REFUSED,
    BadRow,
    ConversationError,
    read_conversations,
)

FORMAT_VERSION = 2  # 2: bad rows reported together, or dropped (data.bad_rows)
PREFIX = "chat"
DATA_FILE = "data.arrow"
MARKERS = "generation markers"
TURN_BY_TURN = "turn by turn (round trip checked)"
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


@dataclass(frozen=True)
class ChatTokenizer:
    """A local tokenizer with a chat template, and how its loss masks are taken."""

    tokenizer: Any
    path: Path
    method: str

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)


#: files that make a checkpoint directory a Hugging Face tokenizer too
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def checkpoint_tokenizer(checkpoint: str | Path | None) -> str | None:
    """``checkpoint`` when it is a directory holding a Hugging Face tokenizer (a target checkpoint's own, the
    default for conversations), else None."""
    if not checkpoint:
        return None
    directory = Path(str(checkpoint))
    return str(directory) if any((directory / name).is_file() for name in TOKENIZER_FILES) else None


def load_chat_tokenizer(path: str | Path) -> ChatTokenizer:
    """The tokenizer of a local directory; refused when it has no chat template (saying how to give one)."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"data.tokenizer={str(path)!r} is not a directory; give a local Hugging Face "
                                "tokenizer directory (tokenizer.json, tokenizer_config.json), e.g. the target "
                                "checkpoint's")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        raise ConversationError(
            f"data.tokenizer={str(path)!r} has no chat template; add one (a chat_template.jinja file, or "
            "\"chat_template\" in tokenizer_config.json: the target model's own template), or point "
            "data.tokenizer at a tokenizer that has one")
    return ChatTokenizer(tokenizer, directory, MARKERS if _GENERATION.search(template) else TURN_BY_TURN)


def encode_conversation(chat: ChatTokenizer, turns: list[dict[str, str]], where: str) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of one conversation: 1 on the assistant's tokens, 0 elsewhere."""
    from jinja2 import TemplateError

    try:
        if chat.method == MARKERS:
            encoded = chat.tokenizer.apply_chat_template(turns, tokenize=True, return_dict=True,
                                                         return_assistant_tokens_mask=True)
            ids, mask = list(encoded["input_ids"]), [int(m) for m in encoded["assistant_masks"]]
        else:
            ids, mask = _turn_by_turn(chat, turns, where)
    except TemplateError as error:  # the template's own checks (e.g. roles must alternate)
        raise BadRow(TEMPLATE_REFUSED, f"{where}: the chat template refused this conversation ({error}); fix the "
                                "turns (e.g. alternate user and assistant) or use a template that accepts them") from None
    if not any(mask):
        raise ConversationError(f"{where}: the chat template marks no assistant token; check the template's "
                                "{% generation %} markers")
    return ids, mask


def _turn_by_turn(chat: ChatTokenizer, turns: list[dict[str, str]], where: str) -> tuple[list[int], list[int]]:
    def render(part: list[dict[str, str]], generation_prompt: bool = False) -> list[int]:
        if not part:
            return []
        return list(chat.tokenizer.apply_chat_template(part, tokenize=True, return_dict=True,
                                                       add_generation_prompt=generation_prompt)["input_ids"])

    ids: list[int] = []
    mask: list[int] = []
    for index, turn in enumerate(turns):
        assistant = turn["role"] == "assistant"
        before = render(turns[:index], generation_prompt=assistant)
        after = render(turns[:index + 1])
        if before[:len(ids)] != ids or after[:len(before)] != before:
            raise ConversationError(
                f"{where}, turn {index}: rendering the conversation turn by turn does not extend the turns "
                "before it (the template rewrites earlier turns, or tokens merge across a turn's boundary), so "
                "the assistant tokens cannot be found this way; use a template with {% generation %} markers")
        mask += [0] * (len(before) - len(ids)) + [int(assistant)] * (len(after) - len(before))
        ids = after
    if render(turns) != ids:
        raise ConversationError(f"{where}: the turn-by-turn rendering does not round-trip to the whole "
                                "conversation's; use a template with {% generation %} markers")
    return ids, mask


def tokenized_conversations(path: Path, split: str | None, tokenizer_dir: str | Path, incomplete: str,
                            cache_dir: Path, progress: bool = True, bad_rows: str = "refuse") -> tuple[Path, dict, str]:
    """The cached Arrow file of ``path``'s conversations tokenized: ``(file, meta, fingerprint)``."""
    chat = load_chat_tokenizer(tokenizer_dir)
    source = cache.tree_signature(path) if path.is_dir() else cache.file_signature(path)
    fingerprint = cache.digest({"format": FORMAT_VERSION, "source": source, "split": split,
                                "tokenizer": cache.tree_signature(chat.path), "incomplete": incomplete,
                                "bad_rows": bad_rows})

    def build(tmp: Path) -> dict:
        import pyarrow as pa
        from tqdm import tqdm

        conversations = read_conversations(path, split, incomplete, bad_rows)  # refuses before tokenizing
        offsets = [0]
        ids: list[int] = []
        mask: list[int] = []
        for where, turns in tqdm(conversations.rows, desc=f"chat template {path.name}", unit=" conversations",
                                 disable=not progress, leave=False):
            try:
                row_ids, row_mask = encode_conversation(chat, turns, f"{path}: {where}")
            except BadRow as problem:
                conversations.bad.add(problem)
                continue
            ids += row_ids
            mask += row_mask
            offsets.append(len(ids))
        if conversations.bad.total and bad_rows == "refuse":
            raise ConversationError(conversations.bad.report(path, conversations.read, "found while tokenizing"))
        if len(offsets) == 1:
            raise ConversationError(f"{path}: no conversation is left ({conversations.words()})")
        offsets_array = pa.array(np.asarray(offsets, dtype=np.int64))
        table = pa.table({"input_ids": pa.LargeListArray.from_arrays(offsets_array, pa.array(ids, type=pa.int32())),
                          "loss_mask": pa.LargeListArray.from_arrays(offsets_array, pa.array(mask, type=pa.int8()))})
        with pa.OSFile(str(tmp / DATA_FILE), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return {"source": str(path), "rows": len(offsets) - 1, "trimmed": conversations.trimmed,
                "bad": conversations.bad.counts,
                "dropped": conversations.dropped, "schema": conversations.schema, "mask": chat.method,
                "tokenizer": str(chat.path), "vocab_size": chat.vocab_size, "words": conversations.words()}

    entry, meta, _ = cache.ensure_entry(cache_dir, PREFIX, fingerprint, build)
    return entry / DATA_FILE, meta, fingerprint


def conversation_lengths(path: Path, split: str | None, tokenizer_dir: str | Path, cache_dir: Path,
                         incomplete: str = "trim", bad_rows: str = "refuse",
                         progress: bool = True) -> tuple[np.ndarray, str]:
    """The token count of every conversation of ``path`` rendered whole with the tokenizer's chat template (the
    cache :func:`tokenized_conversations` builds for training, so a plan and a run count the same tokens), and
    what was read (kept, trimmed, dropped)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arrow, meta, _ = tokenized_conversations(path, split, tokenizer_dir, incomplete, cache_dir, progress, bad_rows)
    with pa.memory_map(str(arrow)) as source:
        ids = pa.ipc.open_stream(source).read_all().column("input_ids")
    lengths = np.ascontiguousarray(pc.list_value_length(ids).to_numpy(zero_copy_only=False), dtype=np.int64)
    return lengths, meta["words"]
