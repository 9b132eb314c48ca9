"""Collators for a user's own causal LM: a packed row of whole documents, or padded rows, for batchlab's micro-batches.

The packed collator is Hugging Face's ``DataCollatorWithFlattening`` (so its keys follow the installed transformers:
``input_ids``, ``labels`` whose first token of every document is -100, ``position_ids`` restarting per document, and
``cu_seq_lens_q/k`` with ``max_length_q/k`` for the varlen attention paths), plus what a budgeted plan needs: samples
longer than the budget cut at it (``oversize="truncate"``), ``use_cache=False`` (transformers finds the documents from
``position_ids`` only when no cache exists, and a config's ``use_cache=True`` creates one even in training: without it a
packed row's documents attend to each other on the sdpa and eager paths), and an empty micro-batch made a one-token
batch that carries no label, marked ``batchlab_empty`` (a short last step gives some ranks one; they must still join the
backward).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

#: the key that marks a micro-batch with no sample (``BatchlabTrainer`` and :func:`empty_loss` read it)
EMPTY_KEY = "batchlab_empty"
IGNORE_INDEX = -100


class PackedCollator:
    """One row of the micro-batch's documents (``[1, total_tokens]``), labels never crossing a document's edge.

    Args:
        max_tokens: samples longer than this are cut to it (the plan's budget; None keeps them whole).
        flash_attn_kwargs: also return ``cu_seq_lens_q/k`` and ``max_length_q/k`` (FlashAttention's varlen path reads
            them; sdpa and eager find the documents from ``position_ids``).
        seq_idx: also return ``seq_idx`` (the document of every token, read by some hybrid models' kernels).
        pad_token_id: the token of an empty micro-batch's placeholder row.
        use_cache: the ``use_cache`` every batch passes to the model (False: see the module docstring; None leaves
            the key out, for models whose forward does not take it).
    """

    def __init__(self, max_tokens: int | None = None, flash_attn_kwargs: bool = True, seq_idx: bool = False,
                 pad_token_id: int = 0, use_cache: bool | None = False) -> None:
        from transformers import DataCollatorWithFlattening

        self.max_tokens = max_tokens
        self.pad_token_id = pad_token_id
        self.extra = {} if use_cache is None else {"use_cache": use_cache}
        self._flatten = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_attn_kwargs, return_seq_idx=seq_idx)

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, Any]:
        features = [_cut(feature, self.max_tokens) for feature in features]
        if not features:
            return {**_empty_batch(self.pad_token_id), "position_ids": torch.zeros((1, 1), dtype=torch.long),
                    **self.extra}
        return {**self._flatten(features), **self.extra}


class PaddedCollator:
    """Rows of the micro-batch's samples padded to the longest, with ``attention_mask`` and -100 labels on padding.

    Written here rather than taken from transformers: its padding collators need a tokenizer and either leave labels
    unpadded (``DataCollatorWithPadding``) or rebuild them (``DataCollatorForLanguageModeling``), and none cuts at the
    budget or handles an empty micro-batch.

    Args:
        max_tokens: samples longer than this are cut to it (None keeps them whole).
        pad_token_id: the padding token.
        padding_side: ``"right"`` (default) or ``"left"``.
    """

    def __init__(self, max_tokens: int | None = None, pad_token_id: int = 0, padding_side: str = "right") -> None:
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side={padding_side!r} must be 'right' or 'left'")
        self.max_tokens, self.pad_token_id, self.padding_side = max_tokens, pad_token_id, padding_side

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, Any]:
        features = [_cut(feature, self.max_tokens) for feature in features]
        if not features:
            return {**_empty_batch(self.pad_token_id), "attention_mask": torch.ones((1, 1), dtype=torch.long)}
        width = max(len(feature["input_ids"]) for feature in features)
        input_ids = torch.full((len(features), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(features), width), dtype=torch.long)
        for row, feature in enumerate(features):
            tokens = torch.as_tensor(feature["input_ids"], dtype=torch.long)
            span = slice(0, tokens.numel()) if self.padding_side == "right" else slice(width - tokens.numel(), width)
            input_ids[row, span] = tokens
            labels[row, span] = torch.as_tensor(feature.get("labels", tokens), dtype=torch.long)
            labels[row, span.start] = IGNORE_INDEX  # a row's first token has no prediction (left: a pad's would cross)
            attention_mask[row, span] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def collator_for(layout: str, max_tokens: int | None = None, **options: Any) -> PackedCollator | PaddedCollator:
    """The collator of a plan's layout: :class:`PackedCollator` for ``"packed"``, :class:`PaddedCollator` else."""
    if layout == "packed":
        return PackedCollator(max_tokens=max_tokens, **options)
    if layout == "padded":
        return PaddedCollator(max_tokens=max_tokens, **options)
    raise ValueError(f"layout={layout!r} must be 'packed' or 'padded'")


def empty_loss(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """A zero loss through every parameter the forward uses, for an empty micro-batch (``batch[EMPTY_KEY]``): a rank
    with nothing to train on in a step still runs its backward, so DDP's gradient all-reduce is joined, not awaited."""
    inputs = {key: value for key, value in batch.items() if key not in (EMPTY_KEY, "labels")}
    return model(**inputs).logits.sum() * 0.0


def _empty_batch(pad_token_id: int) -> dict[str, Any]:
    """An empty micro-batch's one-token placeholder: a pad with no label, marked :data:`EMPTY_KEY`."""
    return {"input_ids": torch.full((1, 1), pad_token_id), "labels": torch.full((1, 1), IGNORE_INDEX),
            EMPTY_KEY: torch.tensor(True)}


def _cut(feature: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    """``feature`` with its tokens (and labels) cut to ``max_tokens``; untouched when it fits."""
    if max_tokens is None or len(feature["input_ids"]) <= max_tokens:
        return feature
    cut = dict(feature)
    for key in ("input_ids", "labels"):
        if key in cut:
            cut[key] = cut[key][:max_tokens]
    return cut
