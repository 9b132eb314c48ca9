"""A reduced draft vocabulary: the drafter predicts only the K most frequent target tokens of its training data.

A real target's LM head is most of a small drafter's cost (SmolLM2: 49,152 rows; the head's forward and backward
over 4,096 positions take 8.2 s on 2 CPU cores at the full vocabulary, 1.1 s at 8,192). EAGLE-3 and SpecForge
keep the drafter's head to the K most frequent target tokens and map its outputs back with two tensors, which are
kept here with their meaning:

* ``d2t`` ``[K]``: draft index ``i`` is target token ``i + d2t[i]`` (an offset, as both store it);
* ``t2d`` ``[V]``: whether a target token is in the draft vocabulary (a bool mask).

The drafter's head is the target's frozen LM head restricted to those rows (a copy of K rows, never trained, never
saved). A label outside the draft vocabulary cannot be predicted: it weighs nothing in the cross-entropy (no row to
push up) but still counts as a label the drafter got wrong — in accuracy and τ, and in the loss sums'
``draft_vocab_misses`` — never silently dropped. Written here because the mapping is a few tensor operations on
top of the target's own head; no library keeps it apart from a whole training framework.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

__all__ = ["DraftVocabulary", "MappedLabels"]


@dataclass(frozen=True)
class MappedLabels:
    """Labels in draft indices (0 where a label is outside the vocabulary), their weights (0 there; None when none
    were given), and the misses (counted labels outside the vocabulary)."""

    labels: torch.Tensor
    loss_weights: torch.Tensor | None
    misses: torch.Tensor


class DraftVocabulary:
    """The target token ids the drafter predicts, ``draft_ids`` ascending, out of ``target_vocab_size``."""

    def __init__(self, draft_ids: Iterable[int] | torch.Tensor, target_vocab_size: int) -> None:
        ids = torch.as_tensor(list(draft_ids) if not isinstance(draft_ids, torch.Tensor) else draft_ids,
                              dtype=torch.long)
        ids = torch.unique(ids)  # sorted ascending, as d2t's offsets assume
        if ids.numel() == 0:
            raise ValueError("a draft vocabulary needs at least one token")
        if int(ids[0]) < 0 or int(ids[-1]) >= target_vocab_size:
            raise ValueError(f"draft token ids must lie in 0..{target_vocab_size - 1} (the target's vocabulary), "
                             f"got {int(ids[0])}..{int(ids[-1])}")
        self.draft_ids = ids
        self.target_vocab_size = int(target_vocab_size)
        index = torch.full((self.target_vocab_size,), -1, dtype=torch.long)
        index[ids] = torch.arange(ids.numel())
        self._draft_index = index  # target id -> draft index, -1 outside

    @classmethod
    def most_frequent(cls, counts: np.ndarray | torch.Tensor, size: int) -> DraftVocabulary:
        """The ``size`` most frequent tokens of ``counts`` ``[V]`` (ties: the lower id first); at most the tokens
        seen at least once, and at least one."""
        counts = torch.as_tensor(np.asarray(counts), dtype=torch.long)
        if size < 1:
            raise ValueError(f"drafter.draft_vocab_size={size}: give at least 1 (or null for the target's vocabulary)")
        order = torch.sort(-counts, stable=True).indices[:size]  # most frequent first, ties by the lower id
        seen = order[counts[order] > 0]
        return cls(seen if seen.numel() else order[:1], counts.numel())

    @classmethod
    def from_samples(cls, samples: Iterable[tuple[np.ndarray, np.ndarray]], target_vocab_size: int,
                     size: int) -> DraftVocabulary:
        """The ``size`` most frequent labels (tokens under the loss mask) of ``samples`` (``(input_ids, loss_mask)``
        pairs, e.g. a run's training rows)."""
        counts = np.zeros(target_vocab_size, dtype=np.int64)
        for input_ids, loss_mask in samples:
            labels = np.asarray(input_ids)[np.asarray(loss_mask, dtype=bool)]
            counts += np.bincount(labels, minlength=target_vocab_size)[:target_vocab_size]
        return cls.most_frequent(counts, size)

    def __len__(self) -> int:
        return int(self.draft_ids.numel())

    @property
    def d2t(self) -> torch.Tensor:
        """``[K]`` offsets: draft index ``i`` is target token ``i + d2t[i]``."""
        return self.draft_ids - torch.arange(len(self))

    @property
    def t2d(self) -> torch.Tensor:
        """``[V]`` bool: the target tokens in the draft vocabulary."""
        return self._draft_index >= 0

    def to_target(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft indices (the drafter's argmax)."""
        return self.draft_ids.to(draft_tokens.device)[draft_tokens]

    def head(self, lm_head: nn.Module) -> nn.Linear:
        """The target's LM head restricted to the draft vocabulary: a frozen copy of its K rows (and bias)."""
        weight = lm_head.weight.detach()
        bias = getattr(lm_head, "bias", None)
        # skip_init: no random initialisation (its draws would shift the drafter's own, seeded after)
        restricted = nn.utils.skip_init(nn.Linear, weight.shape[1], len(self), bias=bias is not None,
                                        device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            restricted.weight.copy_(weight[self.draft_ids.to(weight.device)])
            if bias is not None:
                restricted.bias.copy_(bias.detach()[self.draft_ids.to(weight.device)])
        return restricted.requires_grad_(False)

    def map_labels(self, labels: torch.Tensor, label_valid: torch.Tensor,
                   loss_weights: torch.Tensor | None = None) -> MappedLabels:
        """Target-id labels as draft indices (module docstring): a counted label outside the vocabulary is a miss
        that weighs nothing and that no argmax hits."""
        index = self._draft_index.to(labels.device)[labels]
        outside = index < 0
        return MappedLabels(labels=index.clamp_min(0),
                            loss_weights=None if loss_weights is None else loss_weights.masked_fill(outside, 0),
                            misses=label_valid & outside)
