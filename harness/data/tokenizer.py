"""Byte-level BPE for the embedded corpus, and prompt/completion tokenization.

The tokenizer is trained on the selected documents' text (``tokenizers`` library: byte-level
pre-tokenizer without a prefix space, byte-level decoder, the full 256-byte alphabet so any text
encodes without an unknown token). Ids 0 and 1 are the special tokens ``<|pad|>`` and
``<|endoftext|>``; every id is below the vocabulary size asked for.

A sample is ``ids(prompt) + ids(completion)``, the two parts encoded separately so that the
boundary between unsupervised and supervised tokens is exact; ``loss_mask`` is 0 over the prompt
and 1 over the completion.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

SPECIAL_TOKENS = ("<|pad|>", "<|endoftext|>")
PAD_TOKEN, EOS_TOKEN = SPECIAL_TOKENS
ENCODE_BATCH = 512


def train_tokenizer(texts: Sequence[str], vocab_size: int):
    """Train a byte-level BPE of at most ``vocab_size`` tokens on ``texts``.

    Returns:
        a ``tokenizers.Tokenizer``. Its vocabulary can be smaller than ``vocab_size`` when the
        texts allow fewer merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        # tokenizers' own bars print blank lines in a log and take well under the corpus bar's time: off
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def load_tokenizer(path: str | os.PathLike[str]):
    """A tokenizer saved by :func:`save_tokenizer` (``tokenizer.json``)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.fspath(path))


def save_tokenizer(tokenizer, path: str | os.PathLike[str]) -> None:
    tokenizer.save(os.fspath(path))


def encode_texts(tokenizer, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Encode ``texts`` without special tokens.

    Returns:
        ``(values, lengths)``: the concatenated int32 ids and the int64 length of each text.
    """
    values: list[np.ndarray] = []
    lengths = np.zeros(len(texts), dtype=np.int64)
    for start in range(0, len(texts), ENCODE_BATCH):
        batch = tokenizer.encode_batch(list(texts[start : start + ENCODE_BATCH]), add_special_tokens=False)
        for i, encoding in enumerate(batch):
            ids = np.asarray(encoding.ids, dtype=np.int32)
            values.append(ids)
            lengths[start + i] = ids.size
    flat = np.concatenate(values) if values else np.zeros(0, dtype=np.int32)
    return flat, lengths


def encode_prompt_completion(
    tokenizer, prompts: Sequence[str], completions: Sequence[str]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokenize prompt/completion pairs into samples.

    Returns:
        ``(offsets, input_ids, loss_mask)``: Arrow-style int64 offsets (``len + 1``), the flat
        int32 ids of all samples and the flat int8 mask (0 prompt, 1 completion).
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    prompt_ids, prompt_lengths = encode_texts(tokenizer, prompts)
    completion_ids, completion_lengths = encode_texts(tokenizer, completions)
    lengths = prompt_lengths + completion_lengths
    offsets = np.zeros(len(prompts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    input_ids = np.empty(total, dtype=np.int32)
    loss_mask = np.empty(total, dtype=np.int8)
    # Sample i is prompt i followed by completion i: scatter both flat arrays into place.
    prompt_pos = _positions(prompt_lengths, offsets[:-1])
    completion_pos = _positions(completion_lengths, offsets[:-1] + prompt_lengths)
    input_ids[prompt_pos] = prompt_ids
    loss_mask[prompt_pos] = 0
    input_ids[completion_pos] = completion_ids
    loss_mask[completion_pos] = 1
    return offsets, input_ids, loss_mask


def _positions(lengths: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Output position of every element of a flat ragged array whose row ``r`` (``lengths[r]``
    elements) goes to ``targets[r]`` onwards."""
    rows = np.repeat(np.arange(lengths.size), lengths)
    sources = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1], out=sources[1:])
    return targets[rows] + (np.arange(rows.size, dtype=np.int64) - sources[rows])
