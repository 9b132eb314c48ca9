"""Configuration of the data layer: which tokenized samples to train on, and how to split them.

``DataConfig`` is a plain dataclass (usable as a Hydra structured-config schema). Values are checked
in ``__post_init__``; every error names the field, the bad value and what to give instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

STDLIB_SOURCE = "stdlib"
STDLIB_CHAT_SOURCE = "stdlib-chat"
FORMATS = ("auto", "tokenized", "conversations", "text")
INCOMPLETE_CHOICES = ("trim", "drop", "error")
BAD_ROWS_CHOICES = ("refuse", "drop")
NO_ANCHOR_CHOICES = ("drop", "error")
# 256 byte-level symbols + the two special tokens: the smallest vocabulary a byte-level BPE can have.
MIN_VOCAB_SIZE = 258
CACHE_ENV = "BATCHLAB_CACHE"


class DataConfigError(ValueError):
    """A ``DataConfig`` field holds a value the data layer cannot use."""


@dataclass
class DataConfig:
    """What to load and how to split it (one attribute docstring per field)."""

    source: str = STDLIB_SOURCE
    """What to load: ``stdlib``, ``stdlib-chat``, a shipped artefact, a ``save_to_disk`` directory, a .parquet or .jsonl.

    ``stdlib`` is the embedded corpus (this interpreter's standard library, split into top-level functions and
    classes); ``stdlib-chat`` the same definitions as conversations (:mod:`harness.data.chat.corpus`); ``bundled``
    and ``sharegpt-smollm2`` the main job's and the real-model study's data as shipped (:mod:`harness.data.bundled`);
    a file or directory has an ``input_ids`` column (and optionally ``loss_mask``), or conversations or text
    (``format``).
    """
    split: str | None = None
    """Split of a saved ``DatasetDict`` (not needed when it has a single split)."""
    max_documents: int | None = 800
    """Seeded subset of the embedded corpus (null: all of it), applied before the held-out split.

    Ignored for other sources.
    """
    subset_seed: int = 0
    """Seed of the data subsets (``max_documents``, ``max_rows``); fixed, independent of the run seed."""
    vocab_size: int = 1024
    """Size of the BPE vocabulary trained for the embedded corpus (also a random-weight target's vocabulary).

    ``conf/train.yaml`` passes it to a random-weight target as ``target.vocab_size``, so with another source set it
    to (at least) your largest token id + 1; a pretrained target brings its own vocabulary.
    """
    heldout_fraction: float = 0.05
    """Fraction of samples held out for evaluation, in [0, 1)."""
    max_heldout: int | None = 256
    """Cap on the number of held-out samples (null: no cap)."""
    heldout_seed: int = 1234
    """The held-out split's own seed: the same for every strategy and run seed."""
    validation_fraction: float = 0.0
    """Fraction of the training rows set aside as a validation split for tuning (0: none).

    Never trained on, by the drafter or by a pretrained target, and apart from the held-out test rows; used to
    choose e.g. the learning rate (``eval.split=validation``).
    """
    max_validation: int | None = 256
    """Cap on the number of validation rows (null: no cap)."""
    no_anchor: str = "drop"
    """A sample with no position able to anchor a drafter block: ``drop`` (dropped and counted) or ``error``."""
    cache_dir: str | None = None
    """Where built data is cached; null: ``$BATCHLAB_CACHE`` or ``~/.cache/batchlab``."""
    completions: str = "corpus"
    """``corpus`` (the data's own completions) or ``regenerated`` (the target's greedy completions of the prompts).

    ``regenerated``: every prompt's completion is regenerated greedily by the run's (pretrained) target before
    training, as the anchor trainers do, so that the drafter learns the target's distribution
    (``harness.eval.regenerate``, cached).
    """
    format: str = "auto"
    """How to read the source's rows: ``auto``, ``tokenized``, ``conversations`` or ``text``.

    ``auto``: conversations when the source has a ``messages`` or ``conversations`` column and no ``input_ids``,
    text when it has a ``text`` column and neither. ``tokenized``: ``input_ids`` + ``loss_mask``.
    ``conversations``: OpenAI ``messages`` or ShareGPT ``conversations`` (:mod:`harness.data.chat.read`).
    ``text``: a ``text`` column (:mod:`harness.data.text_tokenize`).
    """
    tokenizer: str | None = None
    """A local Hugging Face tokenizer directory or a .gguf file; null: the target's own, else the embedded one.

    Conversations get its chat template, text and the embedded corpus its tokens. Null: the target checkpoint's
    own when ``target.pretrained`` is one, else the embedded BPE (or the embedded chat tokenizer for
    ``source=stdlib-chat``).
    """
    incomplete: str = "trim"
    """Conversations not ending with an assistant turn: ``trim`` (after the last one), ``drop`` or ``error``.

    ``drop`` also drops a conversation with no assistant turn; ``error`` makes it a bad row; counted either way.
    """
    bad_rows: str = "refuse"
    """Conversations only: unusable rows are all reported and nothing is tokenized (``refuse``), or ``drop``-ped.

    A bad row is not JSON, has an unknown role, an empty turn, content that is not text, no assistant turn, or is
    refused by the chat template; ``drop`` leaves it out and counts it.
    """
    max_rows: int | None = None
    """Your own data: a seeded subset (``subset_seed``) of this many rows, before the held-out split (null: all).

    Drawn after the cut at ``max_length``.
    """
    max_length: int | None = None
    """Your own data: cut a longer row at the end of its last supervised span within this many tokens (null: whole).

    Cut inside its first span when none ends within it; dropped, and counted, when its prompt alone fills it
    (:mod:`harness.data.subset`).
    """
    max_reply_tokens: int = 256
    """With ``completions=regenerated``: the cap on each regenerated completion or assistant turn.

    Else as long as the original; a turn also stops at the tokenizer's end of turn.
    """

    def __post_init__(self) -> None:
        for name, choices in (("format", FORMATS), ("incomplete", INCOMPLETE_CHOICES),
                              ("bad_rows", BAD_ROWS_CHOICES)):
            if getattr(self, name) not in choices:
                raise DataConfigError(f"data.{name}={getattr(self, name)!r}: choose one of {list(choices)}")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise DataConfigError(f"data.tokenizer={self.tokenizer!r}: give a local tokenizer directory or .gguf file, or null")
        if self.completions not in ("corpus", "regenerated"):
            raise DataConfigError(
                f"data.completions={self.completions!r}: give 'corpus' (the data's own completions) or "
                "'regenerated' (the target's greedy completions of the same prompts)"
            )
        if not isinstance(self.source, str) or not self.source.strip():
            raise DataConfigError(
                f"data.source={self.source!r}: give 'stdlib' (the embedded corpus), a save_to_disk "
                "directory, a .parquet file or a .jsonl file"
            )
        if self.split is not None and (not isinstance(self.split, str) or not self.split):
            raise DataConfigError(f"data.split={self.split!r}: give a split name such as 'train', or null")
        _check_int("max_documents", self.max_documents, allow_none=True, minimum=1)
        _check_int("subset_seed", self.subset_seed, minimum=0)
        _check_int("max_reply_tokens", self.max_reply_tokens, minimum=1)
        _check_int("max_rows", self.max_rows, allow_none=True, minimum=1, why="null keeps every row")
        _check_int("max_length", self.max_length, allow_none=True, minimum=2, why="null keeps rows whole")
        for name in ("max_rows", "max_length"):
            if getattr(self, name) is not None and self.source in (STDLIB_SOURCE, STDLIB_CHAT_SOURCE, "bundled"):
                raise DataConfigError(f"data.{name}={getattr(self, name)} applies to your own data, not to "
                                      f"data.source={self.source!r} (use data.max_documents there); set it to null")
        _check_int("vocab_size", self.vocab_size, minimum=MIN_VOCAB_SIZE,
                   why=f"a byte-level BPE needs at least {MIN_VOCAB_SIZE} tokens (256 bytes + 2 special)")
        _check_fraction("heldout_fraction", self.heldout_fraction, example=0.05, zero="0 holds nothing out")
        _check_int("max_heldout", self.max_heldout, allow_none=True, minimum=1,
                   why="use heldout_fraction=0 to hold nothing out, or null for no cap")
        _check_int("heldout_seed", self.heldout_seed, minimum=0)
        _check_fraction("validation_fraction", self.validation_fraction, example=0.1, zero="0: no validation split")
        _check_int("max_validation", self.max_validation, allow_none=True, minimum=1,
                   why="use validation_fraction=0 for no validation split, or null for no cap")
        if self.no_anchor not in NO_ANCHOR_CHOICES:
            raise DataConfigError(
                f"data.no_anchor={self.no_anchor!r}: choose one of {list(NO_ANCHOR_CHOICES)} "
                "('drop' drops and counts samples with no anchor position, 'error' stops)"
            )
        if self.cache_dir is not None and (not isinstance(self.cache_dir, str) or not self.cache_dir):
            raise DataConfigError(
                f"data.cache_dir={self.cache_dir!r}: give a directory path, or null for "
                f"${CACHE_ENV} / ~/.cache/batchlab"
            )

    @property
    def is_stdlib(self) -> bool:
        return self.source == STDLIB_SOURCE

    def resolved_cache_dir(self) -> Path:
        """The cache directory: ``cache_dir``, else ``$BATCHLAB_CACHE``, else ``~/.cache/batchlab``."""
        if self.cache_dir is not None:
            return Path(self.cache_dir).expanduser()
        env = os.environ.get(CACHE_ENV)
        if env:
            return Path(env).expanduser()
        return Path.home() / ".cache" / "batchlab"


def _check_fraction(name: str, value, *, example: float, zero: str) -> None:
    """A share of the rows in [0, 1) (``zero``: what 0 means)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataConfigError(f"data.{name}={value!r}: give a number in [0, 1), e.g. {example:g}")
    if not 0.0 <= float(value) < 1.0:
        raise DataConfigError(f"data.{name}={value!r} is outside [0, 1); give e.g. {example:g} ({zero})")


def _check_int(name: str, value, *, minimum: int, allow_none: bool = False, why: str = "") -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        hint = " or null" if allow_none else ""
        raise DataConfigError(f"data.{name}={value!r}: give an integer >= {minimum}{hint}")
    if value < minimum:
        hint = " or null" if allow_none else ""
        extra = f" ({why})" if why else ""
        raise DataConfigError(f"data.{name}={value!r} is too small: give an integer >= {minimum}{hint}{extra}")
