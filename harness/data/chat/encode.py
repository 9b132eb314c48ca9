"""Conversations to training samples with the target's own chat template: ``input_ids`` and a loss mask on
the assistant's tokens only.

The tokenizer is a local Hugging Face tokenizer directory or a ``.gguf`` checkpoint file (``data.tokenizer``;
transformers reads a GGUF's tokenizer and template with the ``gguf`` package) and the template its own. The
mask comes from the template's ``{% generation %}`` markers where it has them (``return_assistant_tokens_mask``);
otherwise each assistant turn's span is what its rendering adds after the turns before it with the generation
prompt (so the role header is not trained on): each rendering must extend the one before it, and a token must
start at each span's ends (none merged across a turn's boundary), or the conversation is refused naming the row
and turn. The spans are characters of the whole rendering, mapped to tokens by the fast tokenizer's offsets:
the whole batch is tokenized in one call, on every core (a slow tokenizer, with no offsets, renders and
tokenizes turn by turn). Which method was used is recorded (:attr:`ChatTokenizer.method`).

The result is cached like the other sources: one Arrow file of ``input_ids`` and ``loss_mask``, keyed by
the conversations' file, the tokenizer's files (its template included), ``data.incomplete`` and
``data.bad_rows``. A conversation the template refuses (e.g. roles that do not alternate) is a bad row
like those :mod:`harness.data.chat.read` finds: all of them are reported together, or dropped and counted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from jinja2 import TemplateError

from harness.data import cache
from harness.data.chat.read import (
    TEMPLATE_REFUSED,
    BadRow,
    ConversationError,
    read_conversations,
)
from harness.data.hf_tokenizer import load_hf_tokenizer
from harness.data.source_rows import default_loss_mask

FORMAT_VERSION = 4  # 2: bad rows reported together, or dropped (data.bad_rows); 3: batched, GGUF tokenizers;
# 4: assistant turns before the first user turn dropped
PREFIX = "chat"
DATA_FILE = "data.arrow"
MARKERS = "generation markers"
TURN_BY_TURN = "turn by turn (each reply's span, prefixes checked)"
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


@dataclass(frozen=True)
class ChatTokenizer:
    """A local tokenizer with a chat template, and how its loss masks are taken."""

    tokenizer: Any
    path: Path
    method: str
    template: str = ""
    backend: Any = None  # plain_backend(tokenizer): what the batched path encodes with

    @property
    def template_variables(self) -> dict[str, str]:
        """What the tokenizer hands its template besides the messages (its special tokens), as apply_chat_template."""
        return dict(self.tokenizer.special_tokens_map)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)


#: conversations rendered and tokenized per call of the fast tokenizer (its batch runs on every core)
ENCODE_BATCH = 256


def load_chat_tokenizer(path: str | Path) -> ChatTokenizer:
    """:func:`load_hf_tokenizer` with its chat template; refused when it has none (saying how to give one)."""
    location = Path(path).expanduser()
    tokenizer = load_hf_tokenizer(location)
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        raise ConversationError(
            f"data.tokenizer={str(path)!r} has no chat template; add one (a chat_template.jinja file, or "
            "\"chat_template\" in tokenizer_config.json: the target model's own template), or point "
            "data.tokenizer at a tokenizer that has one")
    return ChatTokenizer(tokenizer, location, MARKERS if _GENERATION.search(template) else TURN_BY_TURN, template,
                         plain_backend(tokenizer, post_processor=False) if getattr(tokenizer, "is_fast", False) else None)


def plain_backend(tokenizer: Any, post_processor: bool = True) -> Any:
    """A copy of a fast tokenizer's Rust tokenizer that encodes each text alone, as ``apply_chat_template`` does: no
    padding or truncation a ``tokenizer.json`` may switch on. Without its post-processor (``post_processor=False``,
    for encoding without special tokens, which is then all it would do) its offsets are the untrimmed ones (a
    byte-level post-processor trims a token's leading space from its offsets)."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_padding()
    backend.no_truncation()
    if not post_processor:
        backend.post_processor = None
    return backend


def encode_conversations(chat: ChatTokenizer, rows: list[tuple[str, list[dict[str, str]]]],
                         batch_size: int = ENCODE_BATCH) -> Iterator[list[tuple[np.ndarray, np.ndarray] | BadRow]]:
    """For each batch of ``rows`` (``(where, turns)``), in order: ``(input_ids, loss_mask)`` of each conversation
    (1 on the assistant's tokens, 0 elsewhere), or the :class:`BadRow` the chat template made of it. A conversation
    the mask cannot be found for raises :class:`ConversationError` naming its row.

    One call of the fast tokenizer per batch, on every core; it releases the GIL, so the next batch is rendered
    meanwhile (a thread: the jinja template runs in Python)."""
    batches = (rows[start:start + batch_size] for start in range(0, len(rows), batch_size))
    if chat.method == MARKERS:
        yield from (_with_markers(chat, batch) for batch in batches)
        return
    if not getattr(chat.tokenizer, "is_fast", False):  # no character offsets: rendered and tokenized turn by turn
        yield from ([_or_bad_row(where, turn_by_turn_reference, chat, turns, where) for where, turns in batch]
                    for batch in batches)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize") as pool:
        pending = None
        for batch in batches:
            outcomes = _rendered_batch(chat, batch)
            if pending is not None:
                yield _masked_batch(*pending)
            rendered = [outcome for outcome in outcomes if not isinstance(outcome, BadRow)]
            tokenized = pool.submit(chat.backend.encode_batch, [text for text, _ in rendered], add_special_tokens=False)
            pending = (batch, outcomes, tokenized)
        if pending is not None:
            yield _masked_batch(*pending)


def _masked_batch(batch: list[tuple[str, list[dict[str, str]]]], outcomes: list, tokenized) -> list:
    encodings = iter(tokenized.result())
    return [outcome if isinstance(outcome, BadRow) else _masked(*outcome, next(encodings), where)
            for (where, _), outcome in zip(batch, outcomes, strict=True)]


def _or_bad_row(where: str, encode, *args):
    """``encode(*args)``, or the :class:`BadRow` of a conversation the template refused."""

    try:
        return encode(*args)
    except TemplateError as error:  # the template's own checks (e.g. roles must alternate)
        return BadRow(TEMPLATE_REFUSED, f"{where}: the chat template refused this conversation ({error}); fix the "
                                        "turns (e.g. alternate user and assistant) or use a template that accepts them")


def _with_markers(chat: ChatTokenizer, batch: list[tuple[str, list[dict[str, str]]]]) -> list:
    """The template's ``{% generation %}`` spans, by the library (one batched call; a batch holding a conversation
    the template refuses is encoded one by one to name it)."""

    def encoded(conversations: list[list[dict[str, str]]]) -> list[tuple[np.ndarray, np.ndarray]]:
        out = chat.tokenizer.apply_chat_template(conversations, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True)
        return [(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.int8))
                for ids, mask in zip(out["input_ids"], out["assistant_masks"], strict=True)]

    try:
        results: list = encoded([turns for _, turns in batch])
    except TemplateError:
        results = [_or_bad_row(where, lambda one: encoded([one])[0], turns) for where, turns in batch]
    for (where, _), outcome in zip(batch, results, strict=True):
        if not isinstance(outcome, BadRow) and not outcome[1].any():
            raise ConversationError(f"{where}: the chat template marks no assistant token; check the template's "
                                    "{% generation %} markers")
    return results


@dataclass(frozen=True)
class _Turns:
    """Each assistant turn's character span in the rendered conversation, and its index among the turns."""

    assistant: list[tuple[int, int]]
    index: list[int]


def _rendered_batch(chat: ChatTokenizer, batch: list[tuple[str, list[dict[str, str]]]]) -> list:
    """Each conversation of ``batch`` rendered whole, with the character span of each assistant turn (what its
    rendering adds after the turns before it with the generation prompt: the role header is not trained on), or the
    :class:`BadRow` of a conversation the template refused. Only the renderings around assistant turns are made (the
    mask depends on no other), by the library's renderer, one conversation at a time (only the lengths of its
    prefixes are kept: a long conversation's renderings grow with the square of its turns); a batch holding a
    refused conversation is rendered again one conversation at a time to name it."""
    try:
        return _rendered(chat, batch)
    except TemplateError:
        return [_or_bad_row(where, lambda one: _rendered(chat, [one])[0], (where, turns)) for where, turns in batch]


def _rendered(chat: ChatTokenizer, batch: list[tuple[str, list[dict[str, str]]]]) -> list[tuple[str, _Turns]]:
    from transformers.utils.chat_template_utils import render_jinja_template

    def render(parts: list[list[dict[str, str]]], generation_prompt: bool) -> list[str]:
        rendered, _ = render_jinja_template(conversations=parts, chat_template=chat.template,
                                            add_generation_prompt=generation_prompt, **chat.template_variables)
        return rendered

    out = []
    for where, turns in batch:  # one conversation's renderings at a time: only their lengths are kept
        replies = [index for index, turn in enumerate(turns) if turn["role"] == "assistant"]
        whole = render([turns], generation_prompt=False)[0]
        befores = render([turns[:index] for index in replies if index], generation_prompt=True)
        afters = render([turns[:index + 1] for index in replies], generation_prompt=False)
        befores = iter(befores)
        end, spans = 0, []
        for index, after in zip(replies, afters, strict=True):
            before = next(befores) if index else ""
            # each rendering a prefix of the whole, each longer than the one before: each extends the one before
            if not (end <= len(before) <= len(after) and whole.startswith(before) and whole.startswith(after)):
                raise ConversationError(_NOT_EXTENDED.format(where=where, index=index))
            spans.append((len(before), len(after)))
            end = len(after)
        out.append((whole, _Turns(spans, replies)))
    return out


def _masked(text: str, turns_at: _Turns, encoding, where: str) -> tuple[np.ndarray, np.ndarray]:
    """The assistant mask of one tokenized conversation from character spans: the tokens from the one a reply's
    span starts at to the one the next cut starts at. A token must start at every cut (none may straddle a
    turn's boundary, merging tokens across it: the tokens of the turns so far would then not be a prefix of the
    whole), or the conversation is refused."""
    ids = np.asarray(encoding.ids, dtype=np.int32)

    def token_at(cut: int, index: int) -> int:
        if cut >= len(text):
            return len(ids)
        token = encoding.char_to_token(cut)
        if token is None or encoding.token_to_chars(token)[0] != cut:
            raise ConversationError(_NOT_EXTENDED.format(where=where, index=index))
        return token

    mask = np.zeros(len(ids), dtype=np.int8)
    for (begin, end), index in zip(turns_at.assistant, turns_at.index, strict=True):
        mask[token_at(begin, index):token_at(end, index)] = 1
    if not mask.any():
        raise ConversationError(f"{where}: the chat template renders no assistant token; check the template")
    return ids, mask


_NOT_EXTENDED = ("{where}, turn {index}: rendering the conversation turn by turn does not extend the turns before it "
                 "(the template rewrites earlier turns, or tokens merge across a turn's boundary), so the assistant "
                 "tokens cannot be found this way; use a template with {{% generation %}} markers")


def turn_by_turn_reference(chat: ChatTokenizer, turns: list[dict[str, str]], where: str) -> tuple[np.ndarray, np.ndarray]:
    """The mask token by token, for a tokenizer without character offsets (and the reference the character spans
    are tested against): each turn's rendering tokenized, and each must extend the one before it."""
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
            raise ConversationError(_NOT_EXTENDED.format(where=where, index=index))
        mask += [0] * (len(before) - len(ids)) + [int(assistant)] * (len(after) - len(before))
        ids = after
    if not any(mask):
        raise ConversationError(f"{where}: the chat template renders no assistant token; check the template")
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.int8)


def tokenized_conversations(path: Path, split: str | None, tokenizer_dir: str | Path, incomplete: str,
                            cache_dir: Path, progress: bool = True, bad_rows: str = "refuse") -> tuple[Path, dict, str]:
    """The cached Arrow file of ``path``'s conversations tokenized: ``(file, meta, fingerprint)``."""
    chat = load_chat_tokenizer(tokenizer_dir)
    fingerprint = cache.digest({"format": FORMAT_VERSION, "source": cache.path_signature(path), "split": split,
                                "tokenizer": cache.path_signature(chat.path), "incomplete": incomplete,
                                "bad_rows": bad_rows})

    def build(tmp: Path) -> dict:
        from tqdm import tqdm

        conversations = read_conversations(path, split, incomplete, bad_rows)  # refuses before tokenizing
        rows = conversations.rows
        id_parts: list[np.ndarray] = []
        mask_parts: list[np.ndarray] = []
        with tqdm(total=len(rows), desc=f"chat template {path.name}", unit=" conversations", disable=not progress,
                  leave=False) as bar:
            for outcomes in encode_conversations(chat, [(f"{path}: {where}", turns) for where, turns in rows]):
                for outcome in outcomes:
                    if isinstance(outcome, BadRow):
                        conversations.bad.add(outcome)
                    else:
                        id_parts.append(outcome[0])
                        mask_parts.append(outcome[1])
                bar.update(len(outcomes))
        if conversations.bad.total and bad_rows == "refuse":
            raise ConversationError(conversations.bad.report(path, conversations.read, "found while tokenizing"))
        if not id_parts:
            raise ConversationError(f"{path}: no conversation is left ({conversations.words()})")
        write_samples(tmp / DATA_FILE, id_parts, mask_parts)
        return {"source": str(path), "rows": len(id_parts), "trimmed": conversations.trimmed,
                "unprompted": conversations.unprompted, "bad": conversations.bad.counts,
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
    arrow, meta, _ = tokenized_conversations(path, split, tokenizer_dir, incomplete, cache_dir, progress, bad_rows)
    return sample_lengths(arrow), meta["words"]


def write_samples(path: Path, id_parts: list[np.ndarray], mask_parts: list[np.ndarray] | None = None) -> None:
    """One Arrow stream file of ``input_ids`` (int32) and ``loss_mask`` (int8) rows, one per part; without
    ``mask_parts`` every token is supervised but the first (:func:`~harness.data.source_rows.default_loss_mask`)."""
    import pyarrow as pa

    offsets = np.zeros(len(id_parts) + 1, dtype=np.int64)
    np.cumsum([part.size for part in id_parts], out=offsets[1:])
    ids = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(id_parts).astype(np.int32)))
    mask = (default_loss_mask(ids) if mask_parts is None else
            pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(mask_parts).astype(np.int8))))
    table = pa.table({"input_ids": ids, "loss_mask": mask})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def sample_lengths(arrow: Path) -> np.ndarray:
    """The int64 length of every row of a file :func:`write_samples` wrote."""
    import pyarrow as pa
    import pyarrow.compute as pc

    with pa.memory_map(str(arrow)) as source:
        ids = pa.ipc.open_stream(source).read_all().column("input_ids")
    return np.ascontiguousarray(pc.list_value_length(ids).to_numpy(zero_copy_only=False), dtype=np.int64)
