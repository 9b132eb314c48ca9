"""Where the DFlash drafter's blocks sit in a batch: documents, anchors, block inputs and labels.

The drafter works on documents, never on rows, so that a padded batch, a packed row and each
document alone give the same blocks. This module

* flattens a :class:`~harness.models.layout.TokenBatch` (either layout) into its real tokens, document
  after document (:class:`FlatDocuments`);
* samples anchors (:func:`sample_anchors`): positions ``p`` with ``loss_mask[p]`` and
  ``loss_mask[p + 1]`` both set and the whole block inside the document (``p <= length - B``), up to
  ``num_anchors`` per document, uniformly without replacement, from a ``torch.Generator`` (tests and
  ``batchlab-check``; training draws per sample, :mod:`harness.models.drafter_inputs`);
* lays the blocks out (:class:`BlockLayout`): one block per anchor, in document order, optionally
  padded with unused blocks to a fixed count per document (the fixed shapes of other trainers);
* builds block inputs ``[anchor token, MASK x (B - 1)]`` (:func:`block_input_ids`) and labels
  (:func:`block_targets`): slot ``k`` of the block anchored at ``a`` predicts the token at ``a + k``
  of the same document (slot 0 holds the anchor and is never a label);
* states the visibility rule (:func:`context_visible`): a block anchored at ``a`` sees the context
  positions ``0 .. a - 1`` of its own document (strictly before the anchor), all slots of its own
  block, nothing of other blocks or documents; an unused block sees nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.models.layout import TokenBatch


def map_tensors(obj: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A copy of dataclass ``obj`` with ``move`` applied to every tensor field (others kept)."""
    values = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        values[f.name] = move(value) if isinstance(value, torch.Tensor) else value
    return type(obj)(**values)


def pin_tensors(obj: Any) -> Any:
    """``map_tensors(obj, pin_memory)``, or ``obj`` itself when no accelerator can pin memory."""
    from harness.models.layout import _can_pin

    return map_tensors(obj, lambda t: t.pin_memory()) if _can_pin() else obj


class _Movable:
    """``to(device, non_blocking)`` and ``pin_memory()`` for the tensor dataclasses (no checks)."""

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Any:
        return map_tensors(self, lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Any:
        return pin_tensors(self)



@dataclass(frozen=True)
class FlatDocuments(_Movable):
    """The real tokens of a batch, document after document (``N`` tokens, ``D`` documents)."""

    token_ids: torch.Tensor  # [N] int64
    loss_mask: torch.Tensor  # [N] bool
    doc_starts: torch.Tensor  # [D] int64, offset of each document in the flat tokens
    doc_lengths: torch.Tensor  # [D] int64
    source_index: torch.Tensor  # [N] int64, index of each flat token in input_ids.reshape(-1)
    doc_of_token: torch.Tensor  # [N] int64, document of each flat token

    @property
    def num_documents(self) -> int:
        return int(self.doc_lengths.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def position_in_document(self) -> torch.Tensor:
        """Position of every flat token inside its document (0 at each document start)."""
        return torch.arange(self.num_tokens, device=self.token_ids.device) - self.doc_starts[self.doc_of_token]

    @staticmethod
    def from_batch(batch: TokenBatch) -> FlatDocuments:
        """Flatten a padded or packed batch; padded rows may be right- or left-padded."""
        shape = tuple(batch.input_ids.shape)
        if tuple(batch.loss_mask.shape) != shape:
            raise ValueError(
                f"loss_mask has shape {tuple(batch.loss_mask.shape)} but input_ids has {shape}; "
                "give one loss_mask entry per token"
            )
        device = batch.input_ids.device
        if batch.cu_seqlens is not None:
            cu = batch.cu_seqlens.to(device=device, dtype=torch.long)
            doc_starts, doc_lengths = cu[:-1], cu[1:] - cu[:-1]
            source_index = torch.arange(shape[1], device=device)
        else:
            real = batch.attention_mask.bool()
            doc_lengths = real.sum(dim=1)
            if bool((doc_lengths == 0).any()):
                row = int(torch.nonzero(doc_lengths == 0)[0])
                raise ValueError(f"attention_mask row {row} has no real token; drop empty rows from the batch")
            columns = torch.arange(shape[1], device=device).expand(shape)
            first = torch.where(real, columns, shape[1]).amin(dim=1)
            last = torch.where(real, columns, -1).amax(dim=1)
            if bool((last - first + 1 != doc_lengths).any()):
                row = int(torch.nonzero(last - first + 1 != doc_lengths)[0])
                raise ValueError(
                    f"attention_mask row {row} has holes between real tokens; "
                    "a padded row must hold one document in consecutive positions"
                )
            source_index = torch.nonzero(real.reshape(-1)).squeeze(1)
            doc_starts = torch.cumsum(doc_lengths, 0) - doc_lengths
        doc_of_token = torch.repeat_interleave(torch.arange(doc_lengths.numel(), device=device), doc_lengths)
        return FlatDocuments(
            token_ids=batch.input_ids.reshape(-1)[source_index].long(),
            loss_mask=batch.loss_mask.reshape(-1)[source_index].bool(),
            doc_starts=doc_starts.long(),
            doc_lengths=doc_lengths.long(),
            source_index=source_index,
            doc_of_token=doc_of_token,
        )

    def gather(self, per_token: torch.Tensor) -> torch.Tensor:
        """Select the real tokens of a ``[rows, length, ...]`` tensor laid out like ``input_ids``."""
        return per_token.reshape(-1, *per_token.shape[2:])[self.source_index]


def valid_anchor_mask(documents: FlatDocuments, block_size: int) -> torch.Tensor:
    """``[N]`` bool: the anchor rule of SpecForge (docs/design/target-and-drafter.md) at every flat token.

    ``p`` may anchor a block when ``loss_mask[p]`` and ``loss_mask[p + 1]`` are set and the whole block
    lies inside its document: ``p <= length - block_size`` (so ``p + 1`` is in the same document).
    The same rule as :func:`harness.models.drafter_inputs.anchor_candidates` on one document.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be at least 2, got {block_size}")
    position = documents.position_in_document
    whole_block = position <= documents.doc_lengths[documents.doc_of_token] - block_size
    next_mask = torch.zeros_like(documents.loss_mask)
    next_mask[:-1] = documents.loss_mask[1:]
    return documents.loss_mask & next_mask & whole_block


def sample_anchors(
    documents: FlatDocuments, num_anchors: int, generator: torch.Generator, *, block_size: int
) -> list[torch.Tensor]:
    """Draw up to ``num_anchors`` anchors per document, uniformly without replacement, from ``generator``.

    Candidates follow :func:`valid_anchor_mask`. Returns one sorted int64 tensor of in-document
    positions per document (empty where the document has no candidate). The draw depends only on the
    documents and ``generator``, so a padded batch and a packed row of the same documents get the same
    anchors from the same generator state; it does depend on the neighbours in the batch (one
    generator runs through all of them). Training draws per sample instead
    (:func:`harness.models.drafter_inputs.document_anchors`: a function of seed, epoch and sample).
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be at least 1, got {num_anchors}")
    valid = valid_anchor_mask(documents, block_size)
    device = documents.token_ids.device
    # One uniform key per token; the smallest `num_anchors` keys among a document's valid positions
    # are a uniform sample without replacement. Sorting on (document, key) ranks all documents at once.
    keys = torch.rand(documents.num_tokens, generator=generator, dtype=torch.float64, device=generator.device)
    keys = keys.to(device).masked_fill(~valid, 2.0)
    order = torch.argsort(documents.doc_of_token.double() * 4.0 + keys)
    doc_sorted = documents.doc_of_token[order]
    rank = torch.arange(documents.num_tokens, device=device) - documents.doc_starts[doc_sorted]
    valid_per_doc = torch.zeros_like(documents.doc_lengths).index_add_(0, documents.doc_of_token, valid.long())
    take = rank < valid_per_doc.clamp(max=num_anchors)[doc_sorted]
    chosen = order[take]
    chosen_doc = documents.doc_of_token[chosen]
    chosen_pos = chosen - documents.doc_starts[chosen_doc]
    counts = torch.zeros_like(documents.doc_lengths).index_add_(0, chosen_doc, torch.ones_like(chosen_doc))
    # `order` sorts by document first, so the chosen positions are already grouped by document.
    per_doc = torch.split(chosen_pos, counts.tolist())
    return [positions.sort().values for positions in per_doc]


@dataclass(frozen=True)
class BlockLayout(_Movable):
    """One block per anchor, grouped by document in document order (``NB`` blocks)."""

    block_size: int
    doc_index: torch.Tensor  # [NB] int64, non-decreasing
    anchor: torch.Tensor  # [NB] int64, position of the anchor inside its document
    keep: torch.Tensor  # [NB] bool; False for padding blocks (they see nothing and carry no loss)
    blocks_per_document: torch.Tensor  # [D] int64

    @property
    def num_blocks(self) -> int:
        return int(self.anchor.numel())

    @property
    def num_kept(self) -> int:
        return int(self.keep.sum())

    def slot_positions(self) -> torch.Tensor:
        """``[NB, B]`` in-document position of every slot: ``anchor + k``."""
        return self.anchor[:, None] + torch.arange(self.block_size, device=self.anchor.device)


def build_block_layout(
    documents: FlatDocuments,
    anchors: Sequence[torch.Tensor],
    block_size: int,
    blocks_per_document: int | None = None,
) -> BlockLayout:
    """Lay out one block per anchor; ``anchors[d]`` holds in-document positions of document ``d``.

    Every anchor must leave at least one label inside its document (``0 <= a <= length - 2``): given
    anchors (tests, checks) may put a block partly past the document end, whose labels there do not
    count. Drawn anchors (:func:`sample_anchors`, :func:`~harness.models.drafter_inputs.document_anchors`)
    keep the whole block inside (``a <= length - B``).
    With ``blocks_per_document`` each document is padded with unused blocks (``keep`` False) up to
    that many blocks, as trainers with fixed shapes do; it must be at least the largest anchor count.
    """
    if block_size < 2:
        raise ValueError(
            f"block_size must be at least 2 (slot 0 holds the anchor, slots 1.. are predicted), got {block_size}"
        )
    if len(anchors) != documents.num_documents:
        raise ValueError(
            f"anchors has {len(anchors)} entries but the batch holds {documents.num_documents} documents; "
            "give one tensor of anchor positions per document"
        )
    device = documents.token_ids.device
    lengths = documents.doc_lengths.tolist()
    counts = [int(a.numel()) for a in anchors]
    for doc, (positions, length) in enumerate(zip(anchors, lengths)):
        integer = not (positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool)
        if positions.dim() != 1 or not integer:
            raise ValueError(
                f"anchors[{doc}] must be a 1-D integer tensor, "
                f"got shape {tuple(positions.shape)} dtype {positions.dtype}"
            )
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) > length - 2):
            bad = int(positions.max()) if int(positions.max()) > length - 2 else int(positions.min())
            raise ValueError(
                f"anchors[{doc}] holds position {bad} but document {doc} has {length} tokens; an anchor must "
                f"lie in [0, {length - 2}] so that its block has a label inside the same document"
            )
    width = max(counts, default=0)
    if blocks_per_document is not None and blocks_per_document < width:
        raise ValueError(
            f"blocks_per_document={blocks_per_document} is smaller than the {width} anchors of one document; "
            f"raise it to at least {width} or leave it unset"
        )
    per_doc = [blocks_per_document if blocks_per_document is not None else n for n in counts]
    anchor = torch.zeros(sum(per_doc), dtype=torch.long, device=device)
    keep = torch.zeros(sum(per_doc), dtype=torch.bool, device=device)
    start = 0
    for positions, n_blocks in zip(anchors, per_doc):
        anchor[start : start + positions.numel()] = positions.to(device=device, dtype=torch.long)
        keep[start : start + positions.numel()] = True
        start += n_blocks
    blocks_per_doc = torch.tensor(per_doc, dtype=torch.long, device=device)
    doc_index = torch.repeat_interleave(torch.arange(len(per_doc), device=device), blocks_per_doc)
    return BlockLayout(block_size, doc_index, anchor, keep, blocks_per_doc)


def block_input_ids(documents: FlatDocuments, layout: BlockLayout, mask_token_id: int) -> torch.Tensor:
    """``[NB, B]`` drafter input: the anchor token in slot 0, ``mask_token_id`` elsewhere (all MASK if unused)."""
    shape = (layout.num_blocks, layout.block_size)
    ids = torch.full(shape, mask_token_id, dtype=torch.long, device=layout.anchor.device)
    anchor_tokens = documents.token_ids[documents.doc_starts[layout.doc_index] + layout.anchor]
    ids[:, 0] = torch.where(layout.keep, anchor_tokens, mask_token_id)
    return ids


@dataclass(frozen=True)
class BlockTargets:
    """Labels of slots ``1 .. B-1`` of every block and whether each one counts."""

    labels: torch.Tensor  # [NB, B - 1] int64; 0 where not valid
    valid: torch.Tensor  # [NB, B - 1] bool: kept block, inside the document, loss_mask set


def block_targets(documents: FlatDocuments, layout: BlockLayout) -> BlockTargets:
    """Slot ``k`` (``k >= 1``) of the block anchored at ``a`` predicts the token at ``a + k`` (no shift)."""
    positions = layout.slot_positions()[:, 1:]
    length = documents.doc_lengths[layout.doc_index][:, None]
    inside = positions < length
    flat = documents.doc_starts[layout.doc_index][:, None] + torch.where(inside, positions, 0)
    valid = inside & layout.keep[:, None] & documents.loss_mask[flat]
    labels = torch.where(valid, documents.token_ids[flat], 0)
    return BlockTargets(labels=labels, valid=valid)


def context_visible(anchor: torch.Tensor, keep: torch.Tensor, context_length: int) -> torch.Tensor:
    """``[nb, context_length]`` bool for the blocks of one document: context position ``t < anchor``.

    Built per document (never per packed row): ``nb`` blocks by the document's visible context.
    Unused blocks (``keep`` False) see no context.
    """
    positions = torch.arange(context_length, device=anchor.device)
    return (positions[None, :] < anchor[:, None]) & keep[:, None]
