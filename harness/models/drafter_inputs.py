"""Everything the drafter needs for one micro-batch, prepared on the host (in the DataLoader's collate).

Anchors are a function of the sample, never of its neighbours: :func:`document_anchors` draws a
document's anchors from ``np.random.SeedSequence([seed, epoch, sample_index, ANCHOR_PURPOSE])``, so a
document gets the same anchors under every batching strategy (padded or packed, whatever its
neighbours) and any world size. The rule is SpecForge's (docs/design/target-and-drafter.md): an anchor ``p`` needs
``loss_mask[p]``, ``loss_mask[p + 1]`` and a whole block inside its document, ``p <= length - B``
(:func:`anchor_candidates`).

:meth:`DrafterInputs.build` turns a CPU :class:`~harness.models.layout.TokenBatch` into the block
layout, block input ids, labels, loss weights and their sum ``Σw`` (a host float, for a trainer that
all-reduces it before backward), and per-document slices (host ints) for the dense attention path.
It bounds the drafter's memory with ``max_blocks``: when a micro-batch holds more drawn blocks, the
``max_blocks`` with the smallest keys (the uniform draws of :func:`document_anchors`) over the whole
micro-batch are kept. Every candidate position has one uniform key, a document draws its
``num_anchors`` smallest, and the cap keeps the smallest of those: the kept blocks are a uniform
sample of the micro-batch's candidate positions (each equally likely, within the per-document
``num_anchors`` cap), so documents keep blocks in proportion to their candidates rather than first
come first served. When the cap does not bind nothing changes: the anchors stay a function of the
sample alone. When it binds, which blocks a document keeps depends on its neighbours (unavoidable for
a cap per micro-batch); ``num_blocks_capped`` counts what was dropped.

:meth:`DrafterInputs.to` moves it with one ``non_blocking`` copy per tensor, with no check and no
read back; :meth:`DrafterInputs.pin_memory` pins it (a DataLoader with ``pin_memory=True`` calls it).
The drafter then runs :meth:`~harness.models.drafter.DFlashDrafter.forward_prepared` and
:meth:`~harness.models.drafter.DFlashDrafter.prepared_loss` without host reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from harness.models.anchors import (
    BlockLayout,
    FlatDocuments,
    block_input_ids,
    block_targets,
    build_block_layout,
    map_tensors,
)
from harness.models.drafter_loss import slot_decay
from harness.models.layout import TokenBatch, _can_pin

__all__ = ["ANCHOR_PURPOSE", "DenseSlice", "DrafterInputs", "anchor_candidates", "document_anchors",
           "document_weight_sum"]

# Last entry of the anchor seed sequence: keeps anchor draws apart from any other per-sample draw
# made from (seed, epoch, sample_index). Fixed: changing it changes every run's anchors.
ANCHOR_PURPOSE = 0x0A7C_0001


def anchor_candidates(loss_mask: np.ndarray, block_size: int) -> np.ndarray:
    """int64 positions ``p`` with ``loss_mask[p]``, ``loss_mask[p + 1]`` and ``p <= len - block_size``."""
    if block_size < 2:
        raise ValueError(f"block_size must be at least 2, got {block_size}")
    mask = np.asarray(loss_mask).astype(bool, copy=False).reshape(-1)
    last = mask.size - block_size  # the largest anchor whose block lies inside the document
    if last < 0:
        return np.zeros(0, dtype=np.int64)
    ok = mask[: last + 1] & mask[1 : last + 2]
    return np.flatnonzero(ok).astype(np.int64)


def _check_seed_part(name: str, value: int) -> int:
    value = int(value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (it seeds the anchor draw), got {value}")
    return value


def document_anchors(
    loss_mask: np.ndarray, *, block_size: int, num_anchors: int, seed: int, epoch: int, sample_index: int
) -> tuple[np.ndarray, np.ndarray]:
    """Up to ``num_anchors`` of the document's :func:`anchor_candidates`, uniformly without replacement.

    Returns ``(positions, keys)``: sorted int64 positions and the float64 uniform draws in ``[0, 1)``
    that selected them (aligned with ``positions``). Every candidate gets one uniform key from
    ``np.random.default_rng(np.random.SeedSequence([seed, epoch, sample_index, ANCHOR_PURPOSE]))``;
    the ``num_anchors`` smallest keys are chosen. A function of the sample alone.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be at least 1, got {num_anchors}")
    entropy = [_check_seed_part("seed", seed), _check_seed_part("epoch", epoch),
               _check_seed_part("sample_index", sample_index), ANCHOR_PURPOSE]
    candidates = anchor_candidates(loss_mask, block_size)
    if candidates.size == 0:
        return candidates, np.zeros(0, dtype=np.float64)
    keys = np.random.default_rng(np.random.SeedSequence(entropy)).random(candidates.size)
    if candidates.size > num_anchors:
        chosen = np.sort(np.argsort(keys, kind="stable")[:num_anchors])  # sorted index = sorted position
        candidates, keys = candidates[chosen], keys[chosen]
    return candidates, keys


def document_weight_sum(loss_mask: np.ndarray, anchors: np.ndarray, *, block_size: int,
                        loss_decay_gamma: float) -> float:
    """Σw of one document's blocks anchored at ``anchors``, as :meth:`DrafterInputs.build` weighs them without a
    ``max_blocks`` cap: slot ``k`` (1 .. B-1) of the block at ``p`` weighs ``exp(-(k - 1) / γ)`` (fp32,
    :func:`~harness.models.drafter_loss.slot_decay`) where ``p + k`` lies inside the document and its loss mask
    is set. A function of the sample alone, computed on the host without building a batch."""
    mask = np.asarray(loss_mask).astype(bool, copy=False).reshape(-1)
    anchors = np.asarray(anchors, dtype=np.int64).reshape(-1)
    if anchors.size == 0:
        return 0.0
    slots = np.arange(1, block_size, dtype=np.int64)
    decay = slot_decay(block_size, loss_decay_gamma).numpy().astype(np.float64)  # the training batch's own fp32 values
    positions = anchors[:, None] + slots[None, :]
    inside = positions < mask.size
    valid = inside & mask[np.where(inside, positions, 0)]
    return float((valid * decay).sum())


@dataclass(frozen=True)
class DenseSlice:
    """The blocks of one document for the dense attention path, as host ints.

    Blocks ``block_start .. block_stop - 1`` see the flat context rows ``context_start ..
    context_start + context_length - 1`` (the document's positions before its last kept anchor).
    """

    block_start: int
    block_stop: int
    context_start: int
    context_length: int


def _dense_slices(documents: FlatDocuments, layout: BlockLayout) -> tuple[DenseSlice, ...]:
    """Per document with blocks, its rows and visible context (reads the layout back: host-side use)."""
    counts = layout.blocks_per_document.tolist()
    starts = documents.doc_starts.tolist()
    kept_anchor = torch.where(layout.keep, layout.anchor, 0)
    context_lengths = torch.zeros_like(layout.blocks_per_document).scatter_reduce_(
        0, layout.doc_index, kept_anchor, reduce="amax"
    ).tolist()
    slices, block_start = [], 0
    for doc, (n_blocks, context_length) in enumerate(zip(counts, context_lengths)):
        if n_blocks == 0:
            continue
        slices.append(DenseSlice(block_start, block_start + n_blocks, starts[doc], context_length))
        block_start += n_blocks
    return tuple(slices)


@dataclass(frozen=True)
class DrafterInputs:
    """One micro-batch's drafter inputs: ``NB`` blocks of ``B`` slots over ``N`` real tokens."""

    documents: FlatDocuments
    layout: BlockLayout
    block_input_ids: torch.Tensor  # [NB, B] int64: anchor token, then MASK
    labels: torch.Tensor  # [NB, B-1] int64, token at anchor + k (0 where not valid)
    label_valid: torch.Tensor  # [NB, B-1] bool
    loss_weights: torch.Tensor  # [NB, B-1] float32, decayed, zero where not valid
    context_positions: torch.Tensor  # [N] int64, in-document position of every flat token (RoPE)
    weight_sum: float  # Σ loss_weights (host float)
    dense_slices: tuple[DenseSlice, ...]  # host-side per-document slices for the dense path
    token_shape: tuple[int, int]  # input_ids shape of the batch (target features must match)
    mask_token_id: int
    num_blocks_candidates: int  # blocks drawn before the max_blocks cap
    num_blocks_capped: int  # blocks removed by the cap
    documents_without_anchor: int  # documents with no anchor candidate at all

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @staticmethod
    def build(
        tokens: TokenBatch,
        sample_indices: Sequence[int],
        *,
        block_size: int,
        num_anchors: int,
        mask_token_id: int,
        loss_decay_gamma: float,
        max_blocks: int | None,
        seed: int,
        epoch: int,
        vocab_size: int | None = None,
    ) -> DrafterInputs:
        """Prepare the drafter inputs of a CPU micro-batch (padded or packed).

        ``sample_indices[d]`` names document ``d`` of ``tokens`` (rows of a padded batch, ``cu_seqlens``
        order of a packed row): its anchors come from :func:`document_anchors`. ``max_blocks`` caps the
        blocks (see the module docstring). ``vocab_size``, if given, checks the real token ids here, on
        the host, so that the device path needs no check.
        """
        if tokens.input_ids.device.type != "cpu":
            raise ValueError(
                f"DrafterInputs.build prepares micro-batches on the host; got a batch on {tokens.input_ids.device}"
            )
        if max_blocks is not None and max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1 or None, got {max_blocks}")
        documents = FlatDocuments.from_batch(tokens)
        if len(sample_indices) != documents.num_documents:
            raise ValueError(
                f"{len(sample_indices)} sample indices for {documents.num_documents} documents in the batch; "
                "give one sample index per document, in batch order"
            )
        if vocab_size is not None:
            _check_token_ids(documents, vocab_size)
        loss_mask = documents.loss_mask.numpy()
        bounds = np.concatenate([documents.doc_starts.numpy(), [documents.num_tokens]])
        positions, keys = [], []
        without_anchor = 0
        for doc, sample_index in enumerate(sample_indices):
            p, k = document_anchors(loss_mask[bounds[doc]:bounds[doc + 1]], block_size=block_size,
                                    num_anchors=num_anchors, seed=seed, epoch=epoch, sample_index=int(sample_index))
            without_anchor += int(p.size == 0)
            positions.append(p)
            keys.append(k)
        candidates = sum(p.size for p in positions)
        capped = 0
        if max_blocks is not None and candidates > max_blocks:
            all_keys = np.concatenate(keys)
            order = np.argsort(all_keys, kind="stable")  # ties (never in practice): earlier documents first
            kept = np.zeros(candidates, dtype=bool)
            kept[order[:max_blocks]] = True
            splits = np.cumsum([p.size for p in positions])[:-1]
            positions = [p[m] for p, m in zip(positions, np.split(kept, splits))]
            capped = candidates - max_blocks
        anchors = [torch.from_numpy(np.ascontiguousarray(p, dtype=np.int64)) for p in positions]
        layout = build_block_layout(documents, anchors, block_size)
        return DrafterInputs.from_layout(
            documents, layout, token_shape=tuple(tokens.input_ids.shape), mask_token_id=mask_token_id,
            loss_decay_gamma=loss_decay_gamma, num_blocks_candidates=candidates, num_blocks_capped=capped,
            documents_without_anchor=without_anchor,
        )

    @staticmethod
    def from_layout(
        documents: FlatDocuments,
        layout: BlockLayout,
        *,
        token_shape: tuple[int, ...],
        mask_token_id: int,
        loss_decay_gamma: float,
        num_blocks_candidates: int | None = None,
        num_blocks_capped: int = 0,
        documents_without_anchor: int | None = None,
    ) -> DrafterInputs:
        """Inputs for a given block layout (any device; reads a few values back to the host)."""
        targets = block_targets(documents, layout)
        decay = slot_decay(layout.block_size, loss_decay_gamma, layout.anchor.device)
        weights = targets.valid.to(torch.float32) * decay
        if documents_without_anchor is None:  # documents whose blocks (if any) are all padding
            kept_per_document = torch.zeros_like(layout.blocks_per_document).index_add_(
                0, layout.doc_index, layout.keep.long())
            documents_without_anchor = int((kept_per_document == 0).sum())
        return DrafterInputs(
            documents=documents,
            layout=layout,
            block_input_ids=block_input_ids(documents, layout, mask_token_id),
            labels=targets.labels,
            label_valid=targets.valid,
            loss_weights=weights,
            context_positions=documents.position_in_document,
            weight_sum=float(weights.double().sum()),
            dense_slices=_dense_slices(documents, layout),
            token_shape=(int(token_shape[0]), int(token_shape[1])),
            mask_token_id=int(mask_token_id),
            num_blocks_candidates=layout.num_kept if num_blocks_candidates is None else int(num_blocks_candidates),
            num_blocks_capped=int(num_blocks_capped),
            documents_without_anchor=int(documents_without_anchor),
        )

    def _map(self, move: Callable[[torch.Tensor], torch.Tensor]) -> DrafterInputs:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                values[name] = move(value)
        values["documents"] = map_tensors(self.documents, move)
        values["layout"] = map_tensors(self.layout, move)
        return DrafterInputs(**values)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> DrafterInputs:
        """The inputs on ``device``: one copy per tensor, no check, no read back."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> DrafterInputs:
        """Page-locked host copies (unchanged when no accelerator can pin memory)."""
        if not _can_pin():
            return self
        return self._map(lambda t: t.pin_memory())


def _check_token_ids(documents: FlatDocuments, vocab_size: int) -> None:
    """Raise naming the first real token id outside ``[0, vocab_size)``."""
    ids = documents.token_ids
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        index = int(torch.nonzero(bad)[0])
        doc = int(documents.doc_of_token[index])
        raise ValueError(
            f"token id {int(ids[index])} at position {index - int(documents.doc_starts[doc])} of document "
            f"{doc} is outside the target vocabulary [0, {vocab_size}); tokenize with the target's tokenizer"
        )
